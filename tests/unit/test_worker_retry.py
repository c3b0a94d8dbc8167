"""A request that fails UNAVAILABLE before its first token moves once to another worker; after it, never."""
import asyncio

import grpc
import pytest

from gateway.fleet.worker_stream import WorkerStream
from rpcserver.errors import Unavailable
from vllm_v0.worker.v1 import worker_pb2


class Failed(grpc.aio.AioRpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="worker went away")


class Call:
    """A worker's Generate stream: some tokens, then the end or an error."""

    def __init__(self, tokens, error=None):
        self.tokens, self.error, self.cancelled = tokens, error, False

    def __aiter__(self):
        return self._steps()

    async def _steps(self):
        for t in self.tokens:
            yield worker_pb2.GenerateResponse(token_id=t)
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeWorker:
    def __init__(self, address, call):
        self.address, self.in_flight, self.woken, self.calls = address, 0, 0, 0
        worker = self

        class Stub:
            def Generate(self, work, timeout=None):
                worker.calls += 1
                return call
        self.stub = Stub()

    def wake(self):
        self.woken += 1


class FakeFleet:
    def __init__(self, *workers):
        self.workers = list(workers)

    def pick(self, prompt_ids, exclude=()):
        return next((w for w in self.workers if w.address not in exclude), None)


def tokens(fleet):
    async def run():
        got = []
        async for step in WorkerStream(fleet, worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1]), 5.0):
            got.append(step.token_id)
        return got
    return asyncio.run(run())


def test_unavailable_before_the_first_token_is_retried_on_another_worker():
    first, second = FakeWorker("a", Call([], Failed())), FakeWorker("b", Call([7, 8, 9]))
    assert tokens(FakeFleet(first, second)) == [7, 8, 9]
    assert (first.calls, second.calls) == (1, 1)
    assert first.woken == 1  # taken out of rotation now, not at the next health check
    assert first.in_flight == second.in_flight == 0


def test_after_the_first_token_the_error_reaches_the_client():
    first, second = FakeWorker("a", Call([7], Failed())), FakeWorker("b", Call([7, 8, 9]))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        tokens(FakeFleet(first, second))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert second.calls == 0  # no silent restart: the client has seen a token


def test_only_one_retry_and_only_for_unavailable():
    dead = [FakeWorker(name, Call([], Failed())) for name in "abc"]
    with pytest.raises(grpc.aio.AioRpcError):
        tokens(FakeFleet(*dead))
    assert [w.calls for w in dead] == [1, 1, 0]
    refused = FakeWorker("a", Call([], Failed(grpc.StatusCode.RESOURCE_EXHAUSTED)))
    spare = FakeWorker("b", Call([1]))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        tokens(FakeFleet(refused, spare))
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and spare.calls == 0


def test_no_serving_worker_is_unavailable_with_a_message():
    with pytest.raises(Unavailable, match="no model worker is serving"):
        tokens(FakeFleet())
