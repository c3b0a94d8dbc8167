"""A stream that its worker fails goes on elsewhere, after the tokens it already yielded, within its bounds."""
import asyncio

import grpc
import pytest
from prometheus_client import REGISTRY

from gateway.fleet.worker_stream import ResumePolicy, WorkerStream
from rpcserver.errors import Unavailable
from vllm_v0.worker.v1 import worker_pb2

LAST = worker_pb2.FINISH_REASON_LENGTH


class Failed(grpc.aio.AioRpcError):
    def __init__(self, code=grpc.StatusCode.UNAVAILABLE):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="worker went away")


class Call:
    """A worker's Generate stream: some tokens (the last one finishing, unless cut), then the end or an error."""

    def __init__(self, tokens, error=None, finish=True):
        self.tokens, self.error, self.cancelled = tokens, error, False
        self.finish = finish and error is None

    def __aiter__(self):
        return self._steps()

    async def _steps(self):
        for i, t in enumerate(self.tokens):
            last = self.finish and i == len(self.tokens) - 1
            yield worker_pb2.GenerateResponse(token_id=t, finish_reason=LAST if last else 0)
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeWorker:
    """A serving worker whose Generate calls come from `calls`, in order; it records the requests it got."""

    def __init__(self, address, *calls):
        self.address, self.in_flight, self.woken, self.checks = address, 0, 0, 0
        self.serving, self.streams, self.requests = True, set(), []
        pending = list(calls)
        worker = self

        class Stub:
            def Generate(self, work, timeout=None):
                worker.requests.append(work)
                return pending.pop(0)
        self.stub = Stub()

    @property
    def calls(self):
        return len(self.requests)

    def wake(self):
        self.woken += 1


class FakeFleet:
    """Picks the first serving worker not excluded; `wait_for_change` lets a test run `on_wait` (a worker coming
    back, a check completing) the first time a stream waits."""

    def __init__(self, *workers, on_wait=None):
        self.workers = {w.address: w for w in workers}
        self.on_wait, self.waits = on_wait, 0

    def pick(self, prompt_ids, exclude=(), adapter="", kind="generate"):
        return next((w for w in self.workers.values() if w.address not in exclude and w.serving), None)

    def unserved(self, kind):
        return None

    async def wait_for_change(self, timeout):
        self.waits += 1
        if self.on_wait is not None:
            self.on_wait()
            self.on_wait = None
        else:
            await asyncio.sleep(timeout)


def resumes(cause: str) -> float:
    return REGISTRY.get_sample_value("vllm_v0_gateway_resumes_total", {"cause": cause}) or 0.0


def request(**fields):
    return worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2], max_tokens=10, **fields)


def tokens(fleet, resume=ResumePolicy(), timeout=5.0, work=None):
    async def run():
        got = []
        async for step in WorkerStream(fleet, work or request(), timeout, resume=resume):
            got.append(step.token_id)
        return got
    return asyncio.run(run())


def test_unavailable_before_the_first_token_is_retried_on_another_worker():
    first, second = FakeWorker("a", Call([], Failed())), FakeWorker("b", Call([7, 8, 9]))
    assert tokens(FakeFleet(first, second)) == [7, 8, 9]
    assert (first.calls, second.calls) == (1, 1)
    assert first.woken == 1  # taken out of rotation now, not at the next health check
    assert first.in_flight == second.in_flight == 0 and not first.streams and not second.streams
    assert list(second.requests[0].output_token_ids) == []  # nothing generated yet: a plain retry


def test_after_tokens_the_stream_resumes_after_them_on_another_worker():
    first = FakeWorker("a", Call([7, 8], Failed()))
    second = FakeWorker("b", Call([9, 10, 11]))
    work = request(prompt_logprobs=2)
    counted = resumes("unavailable")
    assert tokens(FakeFleet(first, second), work=work) == [7, 8, 9, 10, 11]  # once each, in order
    assert resumes("unavailable") == counted + 1
    resumed = second.requests[0]
    assert list(resumed.output_token_ids) == [7, 8] and list(resumed.prompt_token_ids) == [1, 2]
    assert resumed.max_tokens == 10  # the whole request's: the worker counts the given ids toward it
    assert not resumed.HasField("prompt_logprobs")  # they went out with the first token
    assert resumed.request_id != "r" and resumed.request_id.startswith("r")  # never clashes with the failed attempt
    assert list(work.output_token_ids) == []  # the caller's request is left as it was


def test_a_stream_that_ends_without_a_finish_reason_resumes():
    first, second = FakeWorker("a", Call([7], finish=False)), FakeWorker("b", Call([8]))
    assert tokens(FakeFleet(first, second)) == [7, 8]
    assert list(second.requests[0].output_token_ids) == [7]


def test_resumes_are_bounded_and_only_unavailable_is_resumed():
    dead = [FakeWorker(name, Call([n], Failed())) for n, name in enumerate("abcd")]
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        tokens(FakeFleet(*dead), resume=ResumePolicy(max_resumes=2))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert [w.calls for w in dead] == [1, 1, 1, 0]
    assert list(dead[2].requests[0].output_token_ids) == [0, 1]
    refused = FakeWorker("a", Call([5], Failed(grpc.StatusCode.RESOURCE_EXHAUSTED)))
    spare = FakeWorker("b", Call([1]))
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        tokens(FakeFleet(refused, spare))
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and spare.calls == 0
    never = FakeWorker("a", Call([], Failed()))
    with pytest.raises(grpc.aio.AioRpcError):
        tokens(FakeFleet(never, FakeWorker("b", Call([1]))), resume=ResumePolicy(max_resumes=0))


def test_with_no_other_worker_it_resumes_on_the_same_one_once_a_check_has_seen_it_serve():
    only = FakeWorker("a", Call([7], Failed()), Call([8, 9]))

    def back():
        only.checks += 1  # a health check since the failure: it serves again

    fleet = FakeFleet(only, on_wait=back)
    assert tokens(fleet) == [7, 8, 9]
    assert fleet.waits == 1 and list(only.requests[1].output_token_ids) == [7]


def test_when_nothing_serves_again_within_the_wait_it_ends_unavailable_saying_so():
    only = FakeWorker("a", Call([7], Failed()))
    with pytest.raises(Unavailable, match="waited 0.3 s"):
        tokens(FakeFleet(only), resume=ResumePolicy(wait_s=0.3))
    with pytest.raises(Unavailable, match="could go on"):  # the request's own deadline bounds the wait too
        tokens(FakeFleet(FakeWorker("a", Call([7], Failed()))), timeout=0.2)


def test_no_serving_worker_is_unavailable_with_a_message():
    with pytest.raises(Unavailable, match="no model worker is serving"):
        tokens(FakeFleet())


def test_a_moved_stream_goes_on_on_another_worker():
    class Stalled:
        """A worker's call that sent one token and then nothing (its engine core died)."""

        def __init__(self):
            self.cancelled = False

        def __aiter__(self):
            return self._steps()

        async def _steps(self):
            yield worker_pb2.GenerateResponse(token_id=7)
            await asyncio.sleep(30)

        def cancel(self):
            self.cancelled = True

    stalled = Stalled()
    first, second = FakeWorker("a", stalled), FakeWorker("b", Call([8, 9]))

    async def run():
        stream = WorkerStream(FakeFleet(first, second), request(), 5.0)
        got = []
        async for step in stream:
            got.append(step.token_id)
            if step.token_id == 7:
                assert first.streams == {stream}
                stream.move()
        return got
    assert asyncio.run(run()) == [7, 8, 9]
    assert list(second.requests[0].output_token_ids) == [7] and not first.streams
