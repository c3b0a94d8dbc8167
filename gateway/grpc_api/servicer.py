"""GatewayService: the public gRPC API, a thin adapter over the generation, embedding and scoring cores."""
from __future__ import annotations

import asyncio

import grpc

from gateway.core.deltas import Delta
from gateway.core.embedding import EmbeddingCore
from gateway.core.generation import GenerationCore
from gateway.core.metrics import RequestRecord
from gateway.core.prompt_runs import PoolingRecord
from gateway.core.request_id import caller_request_id
from gateway.core.scoring import ScoringCore
from gateway.grpc_api.convert import from_proto
from gateway.grpc_api.pooling_convert import embed_reply, embedding_request, score_reply, scoring_request
from rpcserver.pieces import GRPC_MESSAGE_BYTES, piece_budget, split_prompt_logprobs
from rpcserver.status import code_for, grpc_errors
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

FINISH_REASONS = {"eos": gateway_pb2.FINISH_REASON_EOS, "stop": gateway_pb2.FINISH_REASON_STOP,
                  "length": gateway_pb2.FINISH_REASON_LENGTH}


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, core: GenerationCore, model_name: str, log_prompts: bool = False,
                 max_message_bytes: int = GRPC_MESSAGE_BYTES):
        self.core = core
        self.model_name = model_name
        self.log_prompts = log_prompts  # prompts are user data: off the logs unless asked for
        # A message past the send limit would fail the call: long prompt logprobs go in pieces within this.
        self.budget = piece_budget(max_message_bytes)
        self.max_message_bytes = max_message_bytes  # an Embed reply is one message: refused beyond this
        self.embedding = EmbeddingCore(core.downstreams, core.limits_overrides, core.check_adapter)
        self.scoring = ScoringCore(core.downstreams, core.limits_overrides, core.check_adapter)

    @grpc_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        prompt = (request.prompt or [(m.role, m.content) for m in request.messages]) if self.log_prompts else None
        record = RequestRecord(caller_request_id(request.request_id), prompt)  # a bad id is refused in validate()
        error = None
        try:
            req = from_proto(request)
            call_ids: dict[int, str] = {}  # each tool call's id, repeated on its later pieces
            # Deadlines pass down to every downstream call.
            async for delta in self.core.generate(req, record, timeout=context.time_remaining):
                if delta.prompt_logprobs:  # tens of thousands of entries for a long prompt: built on a thread
                    replies = await asyncio.to_thread(self._replies, delta, record.request_id, call_ids)
                else:
                    replies = self._replies(delta, record.request_id, call_ids)
                for reply in replies:
                    yield reply
        except BaseException as e:
            error = e
            raise
        finally:
            record.done(code_for(error, context), error)  # every call, refused ones too: one log line each

    def _replies(self, delta: Delta, request_id: str, call_ids: dict[int, str]) -> list[gateway_pb2.GenerateResponse]:
        return in_pieces(to_proto(delta, request_id, call_ids), self.budget)

    @grpc_errors
    async def Embed(self, request: gateway_pb2.EmbedRequest, context: grpc.aio.ServicerContext
                    ) -> gateway_pb2.EmbedResponse:
        record = PoolingRecord("embed", caller_request_id(request.request_id))  # a bad id is refused in check()
        error = None
        try:
            result = await self.embedding.embed(embedding_request(request), record, timeout=context.time_remaining,
                                                max_reply_bytes=self.max_message_bytes)
            return embed_reply(result, record.request_id)
        except BaseException as e:
            error = e
            raise
        finally:
            record.done(code_for(error, context), error)

    @grpc_errors
    async def Score(self, request: gateway_pb2.ScoreRequest, context: grpc.aio.ServicerContext
                    ) -> gateway_pb2.ScoreResponse:
        record = PoolingRecord("score", caller_request_id(request.request_id))
        error = None
        try:
            result = await self.scoring.score(scoring_request(request), record, timeout=context.time_remaining)
            return score_reply(result, record.request_id)
        except BaseException as e:
            error = e
            raise
        finally:
            record.done(code_for(error, context), error)

    @grpc_errors
    async def GetInfo(self, request, context) -> gateway_pb2.GetInfoResponse:
        limits = self.core.limits()
        return gateway_pb2.GetInfoResponse(
            model=self.model_name or self.core.downstreams.worker_info.model, max_context=limits.max_context,
            max_prompt_tokens=limits.max_prompt_tokens, max_tokens_limit=limits.max_tokens_limit,
            max_stop_strings=limits.max_stop_strings, max_stop_string_chars=limits.max_stop_string_chars,
            max_logprobs=limits.max_logprobs, workers=self.core.downstreams.worker_statuses(),
            adapters=sorted(self.core.adapters.served()) if self.core.adapters is not None else [])


def in_pieces(reply: gateway_pb2.GenerateResponse, budget: int) -> list[gateway_pb2.GenerateResponse]:
    """The reply, after pieces of its prompt logprobs when they pass `budget` (gateway.proto says how);
    the first piece then carries the request id, as the first message does."""
    if not reply.prompt_logprobs:  # every message but perhaps the first: nothing to measure
        return [reply]
    replies = split_prompt_logprobs(reply, budget, gateway_pb2.GenerateResponse)
    replies[0].request_id = reply.request_id
    return replies


def to_proto(delta: Delta, request_id: str,
             call_ids: dict[int, str] | None = None) -> gateway_pb2.GenerateResponse:
    """One response; `call_ids` (kept across one call's deltas) gives later pieces of a tool call its id."""
    call_ids = {} if call_ids is None else call_ids
    for call in delta.tool_calls:
        call_ids.setdefault(call.index, call.id)
    # A cut-off mark adds nothing to a stream: the call's pieces went out as they came, and the finish
    # reason (LENGTH, or STOP for a stop string) says it is cut; sent, it would be an empty piece.
    calls = [gateway_pb2.ToolCall(id=call_ids[c.index], name=c.name or "", arguments=c.arguments)
             for c in delta.tool_calls if c.cut_off is None]
    reply = gateway_pb2.GenerateResponse(
        text=delta.text, token_ids=delta.token_ids, reasoning_text=delta.reasoning_text, tool_calls=calls, logprobs=[
        gateway_pb2.Logprobs(chosen=gateway_pb2.TokenLogprob(token_id=lp.chosen.token_id, logprob=lp.chosen.logprob),
                             top=[gateway_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top])
        for lp in delta.logprobs])
    for entry in delta.prompt_logprobs or ():
        scored = reply.prompt_logprobs.add(token_id=entry.token.token_id, top=[
            gateway_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in entry.top])
        if entry.token.logprob is not None:
            scored.logprob = entry.token.logprob
    if delta.has_first_token:
        reply.request_id = request_id
    if delta.finish_reason:
        reply.finish_reason = FINISH_REASONS[delta.finish_reason]
        reply.stop_reason = delta.stop_reason
        reply.request_id = request_id
        reply.usage.prompt_tokens = delta.prompt_tokens
        reply.usage.completion_tokens = delta.completion_tokens
        if delta.time_to_first_token_s is not None:  # None when nothing was generated (max_tokens 0)
            reply.time_to_first_token_s = delta.time_to_first_token_s
    return reply
