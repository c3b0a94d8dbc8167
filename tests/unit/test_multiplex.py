"""The worker's GenerateMany core against a fake engine client: batching, per-request errors, cancels, the call's end."""
from __future__ import annotations

import asyncio

import grpc

from rpcserver.errors import InvalidArgument, Unavailable
from rpcserver.pieces import piece_budget
from services.model_worker.engine.llm_engine import StepOutput
from services.model_worker.engine.sequence import FinishReason
from services.model_worker.server.multiplex import MultiplexedCall
from vllm_v0.worker.v1 import worker_pb2

WAIT_S = 5.0  # bounded waits on conditions, never a measure of speed


class FakeEngine:
    """Stands in for EngineClient: records submits and aborts; the test plays its steps."""

    def __init__(self, refuse: dict[str, Exception] | None = None):
        self.refuse = refuse or {}
        self.sinks: dict[str, object] = {}  # engine id -> sink, open requests
        self.aborted: list[str] = []

    def submit(self, request_id, prompt_ids, params, sink, output_ids=(), adapter="") -> str:
        if request_id in self.refuse:
            raise self.refuse[request_id]
        engine_id = f"e-{request_id}"
        self.sinks[engine_id] = sink
        return engine_id

    def abort(self, engine_id: str) -> None:
        if self.sinks.pop(engine_id, None) is not None:
            self.aborted.append(engine_id)

    def step(self, *outputs: tuple[str, int, FinishReason | None]) -> None:
        """One step's frame: every output handed to its sink in one go, as EngineClient._dispatch does."""
        for request_id, token, finish in outputs:
            sink = self.sinks[f"e-{request_id}"]
            if finish is not None:
                del self.sinks[f"e-{request_id}"]
            sink.put_nowait(StepOutput(request_id, token, None, [], finish, prompt_tokens=3))

    def fail(self, request_id: str, error: Exception) -> None:
        self.sinks.pop(f"e-{request_id}").put_nowait(error)


def start(request_id: str) -> worker_pb2.GenerateManyRequest:
    return worker_pb2.GenerateManyRequest(start=worker_pb2.GenerateRequest(request_id=request_id,
                                                                           prompt_token_ids=[1, 2, 3]))


def cancel(request_id: str) -> worker_pb2.GenerateManyRequest:
    return worker_pb2.GenerateManyRequest(cancel=request_id)


class Caller:
    """The caller's side of the call: messages sent when the test says, half-close with close()."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def send(self, *messages) -> None:
        for message in messages:
            self.queue.put_nowait(message)

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def messages(self):
        while (message := await self.queue.get()) is not None:
            yield message


async def settle(condition) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.001)


def outputs(response) -> list[tuple]:
    return [(o.request_id, o.error_code) if o.error_code else (o.request_id, o.step.token_id)
            for o in response.outputs]


def test_a_step_is_one_message_and_errors_are_per_request():
    async def run():
        engine = FakeEngine(refuse={"full": Unavailable("the worker is shutting down; retry on another worker")})
        call = MultiplexedCall(lambda: engine, lambda request: None)
        caller = Caller()
        responses = call.serve(caller.messages())
        caller.send(start("a"), start("b"), start("full"), start("a"))
        got = [await anext(responses)]  # the refusals come at once
        await settle(lambda: len(engine.sinks) == 2)
        engine.step(("a", 10, None), ("b", 20, None))
        got.append(await anext(responses))
        engine.step(("a", 11, FinishReason.LENGTH), ("b", 21, None))
        got.append(await anext(responses))
        caller.close()  # b is still open: the call goes on
        engine.fail("b", InvalidArgument("prompt too long"))
        got.append(await anext(responses))
        assert [r async for r in responses] == []  # half-closed and nothing open: the call ends
        return got

    got = asyncio.run(run())
    unavailable, invalid = grpc.StatusCode.UNAVAILABLE.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert outputs(got[0]) == [("full", unavailable), ("a", invalid)]
    assert outputs(got[1]) == [("a", 10), ("b", 20)]
    assert got[1].outputs[0].step.prompt_tokens == 3  # on each request's first step only
    assert got[2].outputs[0].step.prompt_tokens == 0
    assert outputs(got[2]) == [("a", 11), ("b", 21)]
    assert got[2].outputs[0].step.finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert outputs(got[3]) == [("b", invalid)] and got[3].outputs[0].error_message == "prompt too long"


def test_a_cancel_aborts_its_request_and_leaving_the_call_aborts_the_rest():
    async def run():
        engine = FakeEngine()
        call = MultiplexedCall(lambda: engine, lambda request: None)
        caller = Caller()
        responses = call.serve(caller.messages())
        caller.send(start("a"), start("b"), start("c"), cancel("a"), cancel("unknown"))
        pending = asyncio.ensure_future(anext(responses))
        await settle(lambda: engine.aborted == ["e-a"])
        engine.step(("b", 1, None), ("c", 2, None))
        first = await pending
        await responses.aclose()  # what grpc.aio does when the caller cancels the call or goes away
        return outputs(first), engine.aborted, call.open_requests

    first, aborted, still_open = asyncio.run(run())
    assert first == [("b", 1), ("c", 2)]
    assert sorted(aborted) == ["e-a", "e-b", "e-c"] and still_open == 0


def test_an_engine_that_is_not_ready_refuses_each_request_without_ending_the_call():
    async def run():
        def loading():
            raise Unavailable("the model is still loading; retry shortly")
        call = MultiplexedCall(loading, lambda request: None)
        caller = Caller()
        caller.send(start("x"))
        caller.close()
        return [outputs(r) async for r in call.serve(caller.messages())]

    assert asyncio.run(run()) == [[("x", grpc.StatusCode.UNAVAILABLE.value[0])]]


def test_a_step_too_large_for_one_message_goes_out_in_several_under_the_budget():
    limit = 64 << 10
    names = [f"r{i}" for i in range(400)]
    top = [(t, -1.0 - t / 64) for t in range(20)]  # 20 alternatives: some 250 bytes an output

    async def run():
        engine = FakeEngine()
        call = MultiplexedCall(lambda: engine, lambda request: None, max_message_bytes=limit)
        caller = Caller()
        reading = asyncio.create_task(collect(call.serve(caller.messages())))
        caller.send(*(start(name) for name in names))
        caller.close()
        await settle(lambda: len(engine.sinks) == len(names))
        # One step's frame for every request, as the engine client dispatches it.
        for name in names:
            engine.sinks.pop(f"e-{name}").put_nowait(StepOutput(name, 5, -0.5, top, FinishReason.LENGTH, 3))
        return await reading

    async def collect(responses):
        return [r async for r in responses]

    got = asyncio.run(run())
    assert len(got) > 1 and all(r.ByteSize() <= piece_budget(limit) for r in got)
    assert [o.request_id for r in got for o in r.outputs] == names  # every output, in order
    assert all([(t.token_id, t.logprob) for t in o.step.top_logprobs] == top for r in got for o in r.outputs)
