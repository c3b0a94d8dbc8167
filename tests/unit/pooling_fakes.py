"""Fake downstreams for the embedding and scoring cores: the real tokenizer core behind a fake Encode, and
workers whose Embed and Score answer from a formula of the ids (no sockets, no model)."""
from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import grpc

from gateway.fleet.worker_stream import ResumePolicy
from rpcserver.pieces import GRPC_MESSAGE_BYTES
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

HIDDEN_SIZE = 16
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"


def raw_vector(ids) -> list[float]:
    """The fake model's last hidden state for a prompt: any fixed function of all its ids."""
    return [math.sin(sum((j + 1) * t for j, t in enumerate(ids)) * 1e-4 + k) for k in range(HIDDEN_SIZE)]


def fake_logit(ids, token_id: int) -> float:
    return ((sum(ids) * 7 + token_id) % 13) - 6.0


def unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector]


def assert_rows_close(got, want, tolerance: float = 1e-6) -> None:
    """Vectors equal to within float32's rounding, row by row."""
    assert len(got) == len(want)
    for row, expected in zip(got, want):
        assert len(row) == len(expected) and max(abs(a - b) for a, b in zip(row, expected)) <= tolerance


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeTokenizer:
    """Encode on the real tokenizer core; counts the calls and how many ran at once."""

    def __init__(self, core):
        self.core = core
        self.requests: list[tokenizer_pb2.EncodeRequest] = []
        self.running = self.most_running = 0

    async def Encode(self, request, timeout=None):
        self.requests.append(request)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(0)  # let the other calls start: a real one waits on the network
            return tokenizer_pb2.EncodeResponse(token_ids=self.core.encode(request.text, request.add_special_tokens))
        finally:
            self.running -= 1


class FakeWorkerStub:
    """Embed and Score from the formulas above; `failures` are raised first, one per call."""

    def __init__(self, failures=()):
        self.failures = list(failures)
        self.requests: list = []

    async def Embed(self, request: worker_pb2.EmbedRequest, timeout=None) -> worker_pb2.EmbedResponse:
        self.requests.append(request)
        if self.failures:
            raise self.failures.pop(0)
        reply = worker_pb2.EmbedResponse(prompt_tokens=sum(len(i.token_ids) for i in request.inputs))
        for item in request.inputs:
            vector = raw_vector(item.token_ids)
            if request.HasField("dimensions"):
                vector = vector[:request.dimensions]
            reply.embeddings.add(values=unit(vector))
        return reply

    async def Score(self, request: worker_pb2.ScoreRequest, timeout=None) -> worker_pb2.ScoreResponse:
        self.requests.append(request)
        if self.failures:
            raise self.failures.pop(0)
        reply = worker_pb2.ScoreResponse(prompt_tokens=sum(len(i.token_ids) for i in request.inputs))
        for item in request.inputs:
            reply.results.add(logits=[fake_logit(item.token_ids, t) for t in request.token_ids])
        return reply


class FakeWorker:
    def __init__(self, address: str, failures=()):
        self.address = address
        self.stub = FakeWorkerStub(failures)
        self.serving = True
        self.in_flight = 0
        self.checks = 0

    def wake(self) -> None:
        pass  # its next health check comes in the fleet's wait_for_change


class FakeFleet:
    """Picks the first serving worker not excluded."""

    def __init__(self, workers: list[FakeWorker]):
        self.workers = {w.address: w for w in workers}
        self.picks: list[tuple[str, str]] = []  # (address, adapter)

    def serving(self) -> list[FakeWorker]:
        return [w for w in self.workers.values() if w.serving]

    def unserved(self, kind):
        return None

    def pick(self, prompt_ids, exclude=(), adapter="", kind="generate"):
        candidates = [w for w in self.serving() if w.address not in exclude]
        if not candidates:
            return None
        self.picks.append((candidates[0].address, adapter))
        return candidates[0]

    async def wait_for_change(self, timeout: float) -> None:
        await asyncio.sleep(0)
        for worker in self.workers.values():
            worker.checks += 1  # a health check that finds each one serving


def tokenizer_info(prompts: dict[str, str] | None = None, default: str = "", modules=(), pooling=()):
    return tokenizer_pb2.GetInfoResponse(embedding_prompts=prompts or {}, default_embedding_prompt_name=default,
                                         embedding_modules=list(modules), embedding_pooling_modes=list(pooling))


def fake_downstreams(core, workers: list[FakeWorker] | None = None, max_context: int = 64, vocab_size: int = 151936,
                     info=None, max_message_bytes: int = GRPC_MESSAGE_BYTES, max_resumes: int = 3):
    """What the embedding and scoring cores use of Downstreams."""
    return SimpleNamespace(
        tokenizer=FakeTokenizer(core), fleet=FakeFleet(workers or [FakeWorker("w1")]),
        worker_info=worker_pb2.GetInfoResponse(model="fake", max_context=max_context, vocab_size=vocab_size,
                                               hidden_size=HIDDEN_SIZE),
        tokenizer_info=info if info is not None else tokenizer_info({"query": QUERY_PROMPT, "document": ""}),
        resume=ResumePolicy(max_resumes=max_resumes, wait_s=1.0), max_message_bytes=max_message_bytes)
