"""GatewayService: validate, tokenize, stream tokens from the worker, and stream text back."""
from __future__ import annotations

import uuid

import grpc

from gateway.convert import SAMPLING_FIELDS, from_proto
from gateway.downstream import Downstreams
from gateway.metrics import RequestRecord
from gateway.stop import StopStringMatcher
from gateway.validation import GenerationRequest, Limits, check_prompt_length, validate
from rpcserver.errors import Unavailable
from rpcserver.status import code_for, grpc_errors
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

FINISH_REASONS = {worker_pb2.FINISH_REASON_EOS: gateway_pb2.FINISH_REASON_EOS,
                  worker_pb2.FINISH_REASON_LENGTH: gateway_pb2.FINISH_REASON_LENGTH}


class IncrementalText:
    """Turns a stream of ids into text through the tokenizer service, never splitting a character.

    Keeps the short window of ids the stateless DecodeIncremental call needs.
    """

    def __init__(self, downstreams: Downstreams, skip_special_tokens: bool, timeout):
        self.downstreams = downstreams
        self.skip_special_tokens = skip_special_tokens
        self.timeout = timeout
        self.window: list[int] = []
        self.read_offset = 0

    async def add(self, token_ids: list[int], final: bool = False) -> str:
        self.window.extend(token_ids)
        reply = await self.downstreams.tokenizer.DecodeIncremental(
            tokenizer_pb2.DecodeIncrementalRequest(token_ids=self.window, read_offset=self.read_offset,
                                                   skip_special_tokens=self.skip_special_tokens, final=final),
            timeout=self.timeout())
        del self.window[:reply.prefix_advance]
        self.read_offset = reply.read_offset
        return reply.text


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, downstreams: Downstreams, limits_overrides: dict, model_name: str, log_prompts: bool = False):
        self.downstreams = downstreams
        self.limits_overrides = limits_overrides
        self.model_name = model_name
        self.log_prompts = log_prompts  # prompts are user data: off the logs unless asked for

    def limits(self) -> Limits:
        info = self.downstreams.worker_info
        if info is None:
            raise Unavailable("the model worker has not answered yet; retry shortly")
        return Limits.for_worker(info, **self.limits_overrides)

    async def _encode(self, req: GenerationRequest, timeout) -> list[int]:
        encode = tokenizer_pb2.EncodeRequest()
        if req.messages is not None:
            encode.messages.extend(tokenizer_pb2.ChatMessage(role=r, content=c) for r, c in req.messages)
            if req.enable_thinking is not None:
                encode.enable_thinking = req.enable_thinking
        else:
            encode.text = req.prompt
        reply = await self.downstreams.tokenizer.Encode(encode, timeout=timeout())
        return list(reply.token_ids)

    @grpc_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        prompt = (request.prompt or [(m.role, m.content) for m in request.messages]) if self.log_prompts else None
        record = RequestRecord(request.request_id or uuid.uuid4().hex, prompt)
        error = None
        try:
            async for reply in self._generate(request, context, record):
                yield reply
        except BaseException as e:
            error = e
            raise
        finally:
            record.done(code_for(error, context), error)  # every call, refused ones too: one log line each

    async def _generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        record: RequestRecord):
        req = from_proto(request)
        limits = self.limits()
        validate(req, limits)
        request_id = record.request_id
        timeout = context.time_remaining  # deadlines pass down to every downstream call
        prompt_ids = await self._encode(req, timeout)
        record.prompt_tokens = len(prompt_ids)
        max_tokens = check_prompt_length(len(prompt_ids), req.max_tokens, limits)

        work = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
                                          stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
        for name in SAMPLING_FIELDS:
            if getattr(req, name) is not None:
                setattr(work.sampling, name, getattr(req, name))
        if req.logprobs is not None:
            work.logprobs = req.logprobs

        text = IncrementalText(self.downstreams, req.skip_special_tokens, timeout)
        stops = StopStringMatcher(req.stop)
        stream = self.downstreams.worker.Generate(work, timeout=timeout())
        finish, stop_reason = gateway_pb2.FINISH_REASON_UNSPECIFIED, ""
        worker_finished = False
        try:
            async for step in stream:
                record.add_token()
                delta, matched = stops.feed(await text.add([step.token_id], final=bool(step.finish_reason)))
                reply = gateway_pb2.GenerateResponse(text=delta, token_ids=[step.token_id])
                if record.completion_tokens == 1:
                    reply.request_id = request_id
                if step.HasField("logprob"):
                    reply.logprobs.append(_logprobs(step))
                if matched is not None:
                    finish, stop_reason = gateway_pb2.FINISH_REASON_STOP, matched
                elif step.finish_reason:
                    finish = FINISH_REASONS[step.finish_reason]
                    if finish == gateway_pb2.FINISH_REASON_EOS:
                        stop_reason = self.downstreams.token_text.get(step.token_id, str(step.token_id))
                    reply.text += stops.flush()
                if finish:
                    reply.finish_reason = finish
                    reply.stop_reason = stop_reason
                    reply.request_id = request_id
                    reply.usage.prompt_tokens = len(prompt_ids)
                    reply.usage.completion_tokens = record.completion_tokens
                    reply.time_to_first_token_s = record.ttft
                    record.finish_reason = gateway_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
                    yield reply
                    if matched is not None:
                        return  # the worker is still generating: the cancel below stops it
                    # Read the worker's stream to its end, so its call completes OK rather than cancelled.
                    worker_finished = True
                    continue
                yield reply
            if not worker_finished:
                raise Unavailable("the model worker ended the stream without a finish reason")
        finally:
            if not worker_finished:
                stream.cancel()  # frees the worker's sequence on a stop string, an error or a client cancel

    @grpc_errors
    async def GetInfo(self, request, context) -> gateway_pb2.GetInfoResponse:
        limits = self.limits()
        return gateway_pb2.GetInfoResponse(
            model=self.model_name or self.downstreams.worker_info.model, max_context=limits.max_context,
            max_prompt_tokens=limits.max_prompt_tokens, max_tokens_limit=limits.max_tokens_limit,
            max_stop_strings=limits.max_stop_strings, max_stop_string_chars=limits.max_stop_string_chars,
            max_logprobs=limits.max_logprobs)


def _logprobs(step: worker_pb2.GenerateResponse) -> gateway_pb2.Logprobs:
    return gateway_pb2.Logprobs(
        chosen=gateway_pb2.TokenLogprob(token_id=step.token_id, logprob=step.logprob),
        top=[gateway_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in step.top_logprobs])
