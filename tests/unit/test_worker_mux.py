"""The gateway's multiplexed worker calls, against fake GenerateMany calls: no sockets, no worker."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.fleet.worker_stream import MultiplexedCalls, WorkerStream
from gateway.fleet.worker_mux import WorkerMux
from tests.unit.test_worker_retry import Failed, FakeFleet, resumes
from vllm_v0.worker.v1 import worker_pb2

WAIT_S = 5.0  # bounded waits on conditions, never a measure of speed


class FakeCall:
    """A worker's GenerateMany call: records what the gateway sends, answers what the test says."""

    def __init__(self, requests):
        self.sent: list[worker_pb2.GenerateManyRequest] = []
        self.half_closed = asyncio.Event()
        self.cancelled = False
        self._responses: asyncio.Queue = asyncio.Queue()
        self._consumer = asyncio.create_task(self._consume(requests))

    async def _consume(self, requests):
        async for message in requests:
            self.sent.append(message)
        self.half_closed.set()

    def __aiter__(self):
        return self._read()

    async def _read(self):
        while (item := await self._responses.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def reply(self, *outputs: tuple) -> None:
        """One response message: (wire id, token, finish reason) for a step, (wire id, code, message) for an error."""
        message = worker_pb2.GenerateManyResponse()
        for wire_id, value, extra in outputs:
            if isinstance(value, grpc.StatusCode):
                message.outputs.add(request_id=wire_id, error_code=value.value[0], error_message=extra)
            else:
                message.outputs.add(request_id=wire_id, step=worker_pb2.GenerateResponse(token_id=value,
                                                                                       finish_reason=extra))
        self._responses.put_nowait(message)

    def fail(self, code=grpc.StatusCode.UNAVAILABLE) -> None:
        self._responses.put_nowait(Failed(code))

    def end(self) -> None:
        self._responses.put_nowait(None)

    def cancel(self) -> None:
        self.cancelled = True
        self.fail(grpc.StatusCode.CANCELLED)

    @property
    def starts(self) -> dict[str, worker_pb2.GenerateRequest]:
        """Caller's request id -> the start sent (its request_id the wire id)."""
        return {m.start.request_id.rsplit("#", 1)[0]: m.start for m in self.sent if m.HasField("start")}

    @property
    def cancels(self) -> list[str]:
        return [m.cancel for m in self.sent if m.HasField("cancel")]


class Opener:
    """Stands in for a worker stub's GenerateMany: every call it opened, newest last."""

    def __init__(self):
        self.calls: list[FakeCall] = []

    def __call__(self, requests):
        self.calls.append(FakeCall(requests))
        return self.calls[-1]


def work(request_id: str) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=4)


async def settle(condition=lambda: True) -> None:
    """Let the fakes' tasks run until `condition` holds (bounded)."""
    async with asyncio.timeout(WAIT_S):
        await asyncio.sleep(0)
        while not condition():
            await asyncio.sleep(0.001)


async def tokens(request) -> list[int] | grpc.aio.AioRpcError:
    try:
        return [step.token_id async for step in request]
    except grpc.aio.AioRpcError as e:
        return e


LAST = worker_pb2.FINISH_REASON_LENGTH
MORE = worker_pb2.FINISH_REASON_UNSPECIFIED


def test_outputs_go_to_their_request_and_the_idle_call_half_closes():
    async def run():
        opener = Opener()
        mux = WorkerMux(opener, "w")
        a, b = mux.open(work("a"), None), mux.open(work("b"), None)
        reading = [asyncio.create_task(tokens(r)) for r in (a, b)]
        await settle(lambda: len(opener.calls) == 1 and len(opener.calls[0].sent) == 2)
        call = opener.calls[0]
        wa, wb = call.starts["a"].request_id, call.starts["b"].request_id
        assert wa != wb and call.starts["a"].prompt_token_ids == [1, 2, 3] and call.starts["a"].max_tokens == 4
        call.reply((wb, 20, MORE), (wa, 10, MORE))  # one message, both requests
        call.reply((wa, 11, LAST), (wb, 21, MORE))
        await settle(lambda: reading[0].done())
        assert not call.half_closed.is_set()  # b is still open
        call.reply((wb, 22, LAST))
        assert await asyncio.gather(*reading) == [[10, 11], [20, 21, 22]]
        await settle(call.half_closed.is_set)
        assert mux.current is None and call.cancels == []
        call.end()
        # The next request opens a new call rather than waiting on the closed one.
        c = mux.open(work("c"), None)
        await settle(lambda: len(opener.calls) == 2 and opener.calls[1].sent)
        opener.calls[1].reply((opener.calls[1].starts["c"].request_id, 5, LAST))
        assert await tokens(c) == [5]
    asyncio.run(run())


def test_a_failed_call_fails_every_open_request_with_its_status():
    async def run():
        opener = Opener()
        mux = WorkerMux(opener, "w")
        requests = [mux.open(work(name), None) for name in "abc"]
        reading = [asyncio.create_task(tokens(r)) for r in requests]
        await settle(lambda: opener.calls and len(opener.calls[0].sent) == 3)
        call = opener.calls[0]
        call.reply((call.starts["a"].request_id, 7, MORE))
        call.fail(grpc.StatusCode.UNAVAILABLE)
        results = await asyncio.gather(*reading)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results)
        assert [r.code() for r in results] == [grpc.StatusCode.UNAVAILABLE] * 3
        assert results[0].details() == "worker went away"
        assert mux.current is None  # a new request gets a new call
        mux.open(work("d"), None)
        await settle(lambda: len(opener.calls) == 2)
    asyncio.run(run())


def test_a_request_error_ends_only_that_request():
    async def run():
        opener = Opener()
        mux = WorkerMux(opener, "w")
        a, b = mux.open(work("a"), None), mux.open(work("b"), None)
        reading = [asyncio.create_task(tokens(r)) for r in (a, b)]
        await settle(lambda: opener.calls and len(opener.calls[0].sent) == 2)
        call = opener.calls[0]
        wa, wb = call.starts["a"].request_id, call.starts["b"].request_id
        call.reply((wa, grpc.StatusCode.RESOURCE_EXHAUSTED, "the worker's queue is full"), (wb, 3, MORE))
        call.reply((wb, 4, LAST))
        refused, finished = await asyncio.gather(*reading)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.details() == "the worker's queue is full"
        assert finished == [3, 4]
    asyncio.run(run())


def test_a_cancel_is_sent_and_late_outputs_never_reach_a_reused_id():
    async def run():
        opener = Opener()
        mux = WorkerMux(opener, "w")
        first, keep = mux.open(work("x"), None), mux.open(work("keep"), None)
        await settle(lambda: opener.calls and len(opener.calls[0].sent) == 2)
        call = opener.calls[0]
        old_wire = call.starts["x"].request_id
        # Same caller id while it is open: refused, as the worker refuses an id already generating.
        duplicate = await tokens(mux.open(work("x"), None))
        assert duplicate.code() == grpc.StatusCode.INVALID_ARGUMENT and "already generating" in duplicate.details()
        first.cancel()
        again = mux.open(work("x"), None)
        await settle(lambda: len(call.sent) == 4)
        assert call.cancels == [old_wire]
        new_wire = call.starts["x"].request_id
        assert new_wire != old_wire
        call.reply((old_wire, 99, MORE), (new_wire, 1, LAST))  # the cancelled one's step was in flight
        assert await tokens(again) == [1]
        assert not call.half_closed.is_set()  # "keep" is open
        keep.cancel()
        await settle(call.half_closed.is_set)
        assert call.cancels == [old_wire, call.starts["keep"].request_id]
    asyncio.run(run())


def test_past_its_deadline_a_request_is_cancelled_on_the_worker_and_deadline_exceeded():
    async def run():
        opener = Opener()
        mux = WorkerMux(opener, "w")
        late = mux.open(work("late"), 0.05)
        await settle(lambda: opener.calls and opener.calls[0].sent)
        call = opener.calls[0]
        call.reply((call.starts["late"].request_id, 1, MORE))
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            async for step in late:
                got.append(step.token_id)
        assert got == [1] and expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await settle(call.half_closed.is_set)
        assert call.cancels == [call.starts["late"].request_id]
    asyncio.run(run())


class MuxWorker:
    """A fleet worker whose stub opens fake GenerateMany calls, answered by `answer(call)` once it has a start."""

    def __init__(self, address, answer):
        self.address, self.in_flight, self.woken, self.checks = address, 0, 0, 0
        self.serving, self.streams = True, set()
        self.opener = Opener()
        self.answer = answer
        worker = self

        class Stub:
            def GenerateMany(self, requests):
                call = worker.opener(requests)
                asyncio.create_task(worker._answer(call))
                return call
        self.stub = Stub()

    async def _answer(self, call):
        await settle(lambda: call.sent)
        self.answer(call, next(iter(call.starts.values())).request_id)

    def wake(self):
        self.woken += 1


def stream_tokens(fleet) -> list[int]:
    async def run():
        stream = WorkerStream(fleet, work("r"), 5.0, MultiplexedCalls())
        return [step.token_id async for step in stream]
    return asyncio.run(run())


@pytest.mark.parametrize("how", ["call", "request"])
def test_unavailable_before_the_first_token_is_retried_on_another_worker(how):
    def unavailable(call, wire_id):
        if how == "call":
            call.fail(grpc.StatusCode.UNAVAILABLE)  # the worker died
        else:
            call.reply((wire_id, grpc.StatusCode.UNAVAILABLE, "the worker is shutting down"))  # draining

    def serve(call, wire_id):
        call.reply((wire_id, 7, MORE), (wire_id, 8, LAST))

    first, second = MuxWorker("a", unavailable), MuxWorker("b", serve)
    assert stream_tokens(FakeFleet(first, second)) == [7, 8]
    assert (len(first.opener.calls), len(second.opener.calls)) == (1, 1)
    assert first.woken == 1
    assert first.in_flight == second.in_flight == 0


@pytest.mark.parametrize("how", ["call", "request"])
def test_after_tokens_an_unavailable_worker_hands_the_stream_on_after_them(how):
    def dies(call, wire_id):
        call.reply((wire_id, 7, MORE))
        if how == "call":
            call.fail(grpc.StatusCode.UNAVAILABLE)  # the worker died: the shared call broke
        else:
            call.reply((wire_id, grpc.StatusCode.UNAVAILABLE, "the engine core died"))

    def goes_on(call, wire_id):
        call.reply((wire_id, 8, MORE), (wire_id, 9, LAST))

    first, second = MuxWorker("a", dies), MuxWorker("b", goes_on)
    cause = "worker" if how == "call" else "unavailable"  # the call broke, or the worker failed the request
    counted = resumes(cause)
    assert stream_tokens(FakeFleet(first, second)) == [7, 8, 9]
    assert resumes(cause) == counted + 1
    resumed = next(iter(second.opener.calls[0].starts.values()))
    assert list(resumed.output_token_ids) == [7] and list(resumed.prompt_token_ids) == [1, 2, 3]
    assert first.in_flight == second.in_flight == 0


def test_a_moved_stream_is_cancelled_on_the_worker_it_leaves():
    async def run():
        first = MuxWorker("a", lambda call, wire_id: call.reply((wire_id, 7, MORE)))  # then nothing: stranded
        second = MuxWorker("b", lambda call, wire_id: call.reply((wire_id, 8, LAST)))
        stream = WorkerStream(FakeFleet(first, second), work("r"), 5.0, MultiplexedCalls())
        got = []
        async for step in stream:
            got.append(step.token_id)
            if step.token_id == 7:
                stream.move()
        call = first.opener.calls[0]
        await settle(call.half_closed.is_set)
        assert call.cancels == [call.starts["r"].request_id]
        return got
    assert asyncio.run(run()) == [7, 8]
