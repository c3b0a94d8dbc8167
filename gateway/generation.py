"""The gateway's generation core: request -> encode -> worker stream -> text -> stop strings -> deltas.

Plain Python over the downstreams object; the gRPC servicer and the HTTP front both adapt it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.convert import SAMPLING_FIELDS
from gateway.metrics import RequestRecord
from gateway.request_id import new_request_id
from gateway.stop import StopStringMatcher
from gateway.validation import GenerationRequest, Limits, check_prompt_length, validate
from rpcserver.errors import Unavailable
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

FINISH_REASONS = {worker_pb2.FINISH_REASON_EOS: "eos", worker_pb2.FINISH_REASON_LENGTH: "length"}


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    piece: bytes | None = None  # the token's raw bytes, when asked for


@dataclass
class Logprobs:
    chosen: TokenLogprob
    top: list[TokenLogprob]


@dataclass
class Delta:
    """What one worker step adds: text safe to show now, the token, and on the last one how it ended."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "stop" or "length" on the last delta
    stop_reason: str = ""  # the stop string or eos token text that ended it
    prompt_tokens: int = 0
    completion_tokens: int = 0  # so far, counting this delta's token
    time_to_first_token_s: float | None = None  # on the last delta


class GenerationCore:
    """Runs one request at a time per call of `generate`, any number concurrently."""

    def __init__(self, downstreams, limits_overrides: dict):
        self.downstreams = downstreams  # Downstreams, or any object with the same surface
        self.limits_overrides = limits_overrides

    def limits(self) -> Limits:
        info = self.downstreams.worker_info
        if info is None:
            raise Unavailable("the model worker has not answered yet; retry shortly")
        return Limits.for_worker(info, **self.limits_overrides)

    async def encode(self, req: GenerationRequest, timeout: float | None) -> list[int]:
        encode = tokenizer_pb2.EncodeRequest()
        if req.messages is not None:
            encode.messages.extend(tokenizer_pb2.ChatMessage(role=r, content=c) for r, c in req.messages)
            if req.enable_thinking is not None:
                encode.enable_thinking = req.enable_thinking
        else:
            encode.text = req.prompt
        reply = await self.downstreams.tokenizer.Encode(encode, timeout=timeout)
        return list(reply.token_ids)

    async def generate(self, req: GenerationRequest, record: RequestRecord, timeout=lambda: None,
                       with_pieces: bool = False) -> AsyncIterator[Delta]:
        """Deltas of one request; the last has `finish_reason`. Leaving early cancels the worker's sequence.

        `timeout()` gives the seconds left for the request (None: no deadline); `with_pieces`
        adds each logprob token's raw bytes (the OpenAI shapes need token strings).
        """
        limits = self.limits()
        validate(req, limits)
        prompt_ids = await self.encode(req, timeout())
        record.prompt_tokens = len(prompt_ids)
        # Callers choose their ids freely and may reuse one; the worker needs each open request's id to be
        # unique, so it gets the gateway's own.
        record.worker_request_id = new_request_id()
        work = worker_request(req, prompt_ids, check_prompt_length(len(prompt_ids), req.max_tokens, limits),
                              record.worker_request_id)

        stops = StopStringMatcher(req.stop)
        stream = self.downstreams.open_worker_stream(work, timeout())
        text = None
        worker_finished = False
        try:
            text = self.downstreams.detokenizer.open(req.skip_special_tokens)
            async for step in stream:
                record.add_token()
                final = bool(step.finish_reason)
                piece_ids = _piece_ids(step) if with_pieces else []
                new_text, pieces = await text.add([step.token_id], final, piece_ids)
                shown, matched = stops.feed(new_text)
                delta = Delta(text=shown, token_ids=[step.token_id], prompt_tokens=len(prompt_ids),
                              completion_tokens=record.completion_tokens)
                if step.HasField("logprob"):
                    delta.logprobs.append(_logprobs(step, pieces))
                if matched is not None:
                    delta.finish_reason, delta.stop_reason = "stop", matched
                elif final:
                    delta.finish_reason = FINISH_REASONS[step.finish_reason]
                    grammar_done = req.structured_output is not None and not _is_stop_id(step.token_id, req,
                                                                                          self.downstreams)
                    if delta.finish_reason == "eos" and not grammar_done:
                        delta.stop_reason = self.downstreams.token_text.get(step.token_id, str(step.token_id))
                    delta.text += stops.flush()
                if delta.finish_reason:
                    delta.time_to_first_token_s = record.ttft
                    record.finish_reason = delta.finish_reason
                    yield delta
                    if matched is not None:
                        return  # the worker is still generating: the cancel below stops it
                    # Read the worker's stream to its end, so its call completes OK rather than cancelled.
                    worker_finished = True
                    continue
                yield delta
            if not worker_finished:
                raise Unavailable("the model worker ended the stream without a finish reason")
        finally:
            if not worker_finished:
                stream.cancel()  # frees the worker's sequence on a stop string, an error or a client cancel
            if text is not None:
                text.cancel()  # a no-op once its final ids went out


def worker_request(req: GenerationRequest, prompt_ids: list[int], max_tokens: int,
                   request_id: str) -> worker_pb2.GenerateRequest:
    work = worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, max_tokens=max_tokens,
                                      stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)
    for name in SAMPLING_FIELDS:
        if getattr(req, name) is not None:
            setattr(work.sampling, name, getattr(req, name))
    if req.logprobs is not None:
        work.logprobs = req.logprobs
    if req.structured_output is not None:
        kind, value = req.structured_output
        if kind == "choice":
            work.structured_output.choice.choices.extend(value)
        else:
            setattr(work.structured_output, kind, value)
    return work


def _is_stop_id(token_id: int, req: GenerationRequest, downstreams) -> bool:
    """Whether an "eos" finish came from an eos or stop token id, not a completed structured output."""
    info = downstreams.worker_info
    return token_id in req.stop_token_ids or (info is not None and token_id in info.eos_token_ids)


def _piece_ids(step: worker_pb2.GenerateResponse) -> list[int]:
    if not step.HasField("logprob"):
        return []
    return [step.token_id, *(t.token_id for t in step.top_logprobs)]


def _logprobs(step: worker_pb2.GenerateResponse, pieces: list[bytes]) -> Logprobs:
    ids = [step.token_id, *(t.token_id for t in step.top_logprobs)]
    values = [step.logprob, *(t.logprob for t in step.top_logprobs)]
    pieces = pieces or [None] * len(ids)
    chosen, *top = (TokenLogprob(i, v, p) for i, v, p in zip(ids, values, pieces))
    return Logprobs(chosen, top)
