"""Prompts run without generating (embeddings, reranker scores): encoded once per distinct text, checked against
the context, and sent to the workers in calls that fit gRPC's message limit, all at once."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from prometheus_client import Counter

from gateway.core.validation import RequestLimits
from gateway.fleet.worker_call import call_worker
from rpcserver.errors import InvalidArgument, Unavailable
from rpcserver.pieces import piece_budget, runs
from vllm_v0.tokenizer.v1 import tokenizer_pb2

log = logging.getLogger("gateway.requests")

# Inputs (texts, or documents to score) in one call: each is a prompt on the worker, and the reply holds
# them all. OpenAI takes at most 2048 inputs per embeddings request.
MAX_INPUTS = 2048
# What one input adds to a worker call at most: 5 bytes per id (a varint of 32 bits) and its message's framing.
ID_BYTES, INPUT_BYTES = 5, 16

FINISHED = Counter("vllm_v0_gateway_pooling_requests", "Embed and Score calls (embeddings, reranking, scores) "
                   "by kind and how they ended: the gRPC status name", ["kind", "code"])
PROMPT_TOKENS = Counter("vllm_v0_gateway_pooling_prompt_tokens", "tokens of the inputs that Embed and Score calls "
                        "ran on the workers", ["kind"])


@dataclass
class PoolingRecord:
    """One Embed or Score call, for its log line and metrics; `done()` writes them once."""
    kind: str  # "embed" or "score"
    request_id: str
    inputs: int = 0
    prompt_tokens: int = 0
    arrival: float = field(default_factory=time.perf_counter)

    def done(self, code: grpc.StatusCode, error: BaseException | None = None) -> None:
        FINISHED.labels(self.kind, code.name).inc()
        PROMPT_TOKENS.labels(self.kind).inc(self.prompt_tokens)
        line = (f"request {self.request_id}: {code.name}, {self.kind} {self.inputs} inputs, prompt "
                f"{self.prompt_tokens} tokens, total {time.perf_counter() - self.arrival:.3f} s")
        if code != grpc.StatusCode.OK and error is not None:
            why = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            line += f", why {why or type(error).__name__!r}"
        log.info("%s", line)


def check_inputs(count: int, name: str) -> None:
    if count == 0:
        raise InvalidArgument(f"{name} is empty: give at least one input")
    if count > MAX_INPUTS:
        raise InvalidArgument(f"{name} holds {count} inputs; at most {MAX_INPUTS} are allowed in one request")


def check_text(text: str, name: str, limits: RequestLimits) -> None:
    if len(text) > limits.max_prompt_chars:
        raise InvalidArgument(f"{name} is {len(text)} characters; at most {limits.max_prompt_chars} are allowed")


def input_token_limit(info, overrides: dict) -> int:
    """The most tokens one input may have: the worker's context (nothing is generated after it), or less under
    --max-prompt-tokens."""
    if info is None:
        raise Unavailable("the model worker has not answered yet; retry shortly")
    wanted = overrides.get("max_prompt_tokens")
    return min(wanted, info.max_context) if wanted else info.max_context


def check_ids(ids: Sequence[int], name: str, max_tokens: int, vocab_size: int) -> None:
    """An input's ids: some, within the context, and (when the vocabulary is known) each an id of it."""
    if not len(ids):
        raise InvalidArgument(f"{name} is empty after tokenization; give some text")
    if len(ids) > max_tokens:
        raise InvalidArgument(f"{name} is {len(ids)} tokens; at most {max_tokens} fit the model's context")
    if min(ids) < 0 or (vocab_size and max(ids) >= vocab_size):
        bad = next(i for i, t in enumerate(ids) if t < 0 or (vocab_size and t >= vocab_size))
        raise InvalidArgument(f"{name}[{bad}] is {ids[bad]}, not a token id of this model's vocabulary "
                              f"[0, {(vocab_size or 2 ** 32) - 1}]")


async def encode_texts(tokenizer, texts: Sequence[str], add_special_tokens: bool,
                       timeout: float | None) -> list[Sequence[int]]:
    """Each text's ids: one Encode per distinct text, all at once."""
    distinct = list(dict.fromkeys(texts))
    replies = await all_or_none([tokenizer.Encode(tokenizer_pb2.EncodeRequest(
        text=text, add_special_tokens=add_special_tokens), timeout=timeout) for text in distinct])
    ids = {text: reply.token_ids for text, reply in zip(distinct, replies)}
    return [ids[text] for text in texts]


async def run_on_workers(downstreams, method: str, prompts: Sequence[Sequence[int]], reply_bytes: int,
                         make_request: Callable[[range], object], timeout: float | None, adapter: str = "") -> list:
    """The replies of `method` over all `prompts`, in calls of consecutive prompts that keep each request and
    reply within gRPC's message limit (`reply_bytes` per prompt at most), all at once: the workers batch them.
    `make_request(positions)` builds the call for those prompts; each call is routed by its first prompt."""
    budget = piece_budget(downstreams.max_message_bytes)
    sizes = [max(ID_BYTES * len(ids), reply_bytes) + INPUT_BYTES for ids in prompts]
    calls = []
    for positions in runs(sizes, budget):
        calls.append(call_worker(downstreams.fleet, downstreams.resume, method, make_request(positions),
                                 list(prompts[positions.start]), timeout, adapter))
    return await all_or_none(calls)


async def all_or_none(calls: Sequence[Awaitable]) -> list:
    """The results of `calls`, run at once; the first to fail cancels the others and is raised."""
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [task.exception() for task in tasks if task in done and task.exception() is not None]
        if errors:
            raise errors[0]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()  # a no-op on those done
