"""Long prompt logprobs are built and joined off the event loop: neighbours go first, and a request keeps its order."""
from __future__ import annotations

import asyncio
import threading

from gateway.fleet.step_stream import PieceJoin
from rpcserver.pieces import PromptLogprobsJoiner, split_prompt_logprobs
from services.model_worker.engine.llm_engine import StepOutput
from services.model_worker.engine.sequence import FinishReason
from services.model_worker.server import multiplex
from services.model_worker.server.multiplex import OFF_LOOP_POSITIONS, MultiplexedCall
from services.model_worker.server.servicer import ModelWorkerServicer
from tests.unit.test_multiplex import Caller, FakeEngine, outputs, settle, start
from vllm_v0.worker.v1 import worker_pb2

WAIT_S = 5.0  # bounded waits on conditions, never a measure of speed
POSITIONS = OFF_LOOP_POSITIONS + 1


def prompt_scores(positions: int) -> list:
    return [None] + [(-1.0 - p / 64, [(p + i, -2.0 - i / 64) for i in range(3)]) for p in range(1, positions)]


class HeldBuild:
    """Wraps step_messages: records the thread of each long prompt's build, which waits for `release`.

    On the loop's own thread it never waits (that would only freeze the test): there the thread recorded
    is what fails it.
    """

    def __init__(self, monkeypatch):
        self.build = multiplex.step_messages
        self.threads: list[threading.Thread] = []
        self.started = threading.Event()
        self.release = threading.Event()
        monkeypatch.setattr(multiplex, "step_messages", self)

    def __call__(self, out, first, budget):
        if out.prompt_logprobs:
            self.threads.append(threading.current_thread())
            if threading.current_thread() is not threading.main_thread():
                self.started.set()
                self.release.wait(WAIT_S)
        return self.build(out, first, budget)


def test_a_long_prompts_logprobs_build_on_a_thread_while_a_neighbours_outputs_go_out(monkeypatch):
    held = HeldBuild(monkeypatch)
    scores = prompt_scores(POSITIONS)

    async def run():
        engine = FakeEngine()
        call = MultiplexedCall(lambda: engine, lambda request: None)
        caller = Caller()
        responses = call.serve(caller.messages())
        caller.send(start("big"), start("small"))
        caller.close()
        first = asyncio.ensure_future(anext(responses))  # the call reads its requests while it is read
        await settle(lambda: len(engine.sinks) == 2)
        engine.sinks["e-big"].put_nowait(StepOutput("big", 5, None, [], None, POSITIONS, scores))
        engine.step(("small", 9, None))
        engine.step(("big", 6, FinishReason.LENGTH), ("small", 10, FinishReason.LENGTH))
        # Both of the neighbour's steps go out while the long prompt's message cannot have been built (its
        # build waits for the release); the long request's second token waits behind its first.
        before = outputs(await first)
        held.release.set()
        after = [r async for r in responses]
        return before, after

    before, after = asyncio.run(run())
    assert held.threads[0] is not threading.main_thread()
    assert held.threads[0].name.startswith("step-messages")
    assert before == [("small", 9), ("small", 10)]
    steps = [o.step for r in after for o in r.outputs]
    assert [s.token_id for s in steps] == [5, 6]
    assert [(e.logprob, [(t.token_id, t.logprob) for t in e.top]) if e.HasField("logprob") else None
            for e in steps[0].prompt_logprobs] == scores
    assert steps[0].prompt_tokens == POSITIONS and steps[1].prompt_tokens == 0


def test_a_request_cancelled_while_its_output_is_built_sends_nothing_more(monkeypatch):
    held = HeldBuild(monkeypatch)

    async def run():
        engine = FakeEngine()
        call = MultiplexedCall(lambda: engine, lambda request: None)
        caller = Caller()
        responses = call.serve(caller.messages())
        caller.send(start("big"))
        rest = asyncio.ensure_future(collect(responses))
        await settle(lambda: len(engine.sinks) == 1)
        engine.sinks["e-big"].put_nowait(StepOutput("big", 5, None, [], None, POSITIONS, prompt_scores(POSITIONS)))
        engine.step(("big", 6, None))
        await asyncio.to_thread(held.started.wait, WAIT_S)
        caller.send(multiplex.worker_pb2.GenerateManyRequest(cancel="big"))
        caller.close()
        await settle(lambda: engine.aborted == ["e-big"])
        held.release.set()
        return await rest

    async def collect(responses):
        return [r async for r in responses]

    assert asyncio.run(run()) == []


def test_generate_builds_a_long_prompts_logprobs_on_a_thread(monkeypatch):
    held = HeldBuild(monkeypatch)
    held.release.set()

    class OneStep:
        def make_params(self, overrides):
            return overrides

        async def generate(self, request_id, prompt_ids, params, output_ids=(), adapter=""):
            yield StepOutput(request_id, 5, None, [], FinishReason.LENGTH, POSITIONS, prompt_scores(POSITIONS))

    class Context:
        pass

    async def run():
        servicer = ModelWorkerServicer("tiny", OneStep())
        return [m async for m in servicer.Generate(worker_pb2.GenerateRequest(request_id="r"), Context())]

    messages = asyncio.run(run())
    assert [m.token_id for m in messages] == [5] and len(messages[0].prompt_logprobs) == POSITIONS
    assert held.threads[0] is not threading.main_thread()


def test_the_gateway_joins_a_long_prompts_pieces_on_a_thread(monkeypatch):
    pieces = 3
    whole = worker_pb2.GenerateResponse(token_id=5, prompt_tokens=3000)
    for p in range(3000):
        whole.prompt_logprobs.add(logprob=-1.0, top=[worker_pb2.TokenLogprob(token_id=p, logprob=-2.0)])
    steps = split_prompt_logprobs(whole, whole.ByteSize() // pieces,
                                  lambda: worker_pb2.GenerateResponse(prompt_logprobs_only=True))
    assert len(steps) >= pieces
    threads = []
    complete = PromptLogprobsJoiner.complete

    def recorded(joiner, message):
        threads.append(threading.current_thread())
        return complete(joiner, message)

    monkeypatch.setattr(PromptLogprobsJoiner, "complete", recorded)

    async def run():
        join = PieceJoin()
        return [joined for step in steps for joined in await join([step])]

    joined = asyncio.run(run())
    assert len(joined) == 1 and len(joined[0].prompt_logprobs) == 3000 and joined[0].token_id == 5
    assert threads and threads[0] is not threading.main_thread()
