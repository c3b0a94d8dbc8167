"""Under load each stream waits its share of the gateway's message budget, and its tokens go out together.

The reference for the text is tokenizers' own decode of the ids (Rust), not the gateway's incremental path.
"""
from __future__ import annotations

import asyncio

import pytest

from gateway.core.generation import GenerationCore
from gateway.core.metrics import RequestRecord
from gateway.core.pacing import MIN_INTERVAL_S, MessagePacing
from gateway.core.validation import GenerationRequest
from gateway.fleet.step_stream import StepBuffer, StepStream
from gateway.main import parse_args as gateway_args
from tests.unit.test_coalescing import LONG_TEXT, WAIT_S, reference_text, step
from tests.unit.test_generation_core import FakeDownstreams


def test_no_stream_waits_without_a_rate_or_under_a_light_load():
    assert MessagePacing(0).next_message_at(5.0) is None
    pacing = MessagePacing(5000)
    for _ in range(int(MIN_INTERVAL_S * 5000) - 1):  # 9 streams: 1.8 ms each, under the floor
        pacing.opened()
    assert pacing.next_message_at(5.0) is None
    pacing.opened()
    assert pacing.next_message_at(5.0) is not None


@pytest.mark.parametrize("streams", [10, 64, 256, 1000])
def test_a_stream_waits_its_share_rounded_up_to_a_grid_shared_by_its_neighbours(streams):
    pacing = MessagePacing(5000)
    for _ in range(streams):
        pacing.opened()
    interval = streams / 5000
    sent = [100.0 + interval * k / 16 for k in range(16)]  # sends spread over one interval
    wakes = [pacing.next_message_at(at) for at in sent]
    for at, wake in zip(sent, wakes):
        assert at + interval <= wake <= at + interval * 1.25 + 1e-9
    # The grid is finer than a quarter of the interval and coarser than an eighth: 16 sends wake in 9 groups
    # at most, each group sharing one tokenizer message.
    assert len(set(wakes)) <= 9
    pacing.closed()
    assert pacing.open_streams == streams - 1


def test_a_held_buffer_keeps_its_steps_until_the_time_comes():
    async def scenario():
        loop = asyncio.get_running_loop()
        buffer = StepBuffer()
        buffer.put(step(1, 0, False, None))
        assert [s.token_id for s in await buffer.take()] == [1]
        buffer.hold_until = loop.time() + 0.05
        taker = asyncio.ensure_future(buffer.take())
        for token_id in (2, 3, 4):
            await asyncio.sleep(0)
            buffer.put(step(token_id, 0, False, None))
        await asyncio.sleep(0.01)
        assert not taker.done()  # steps came, but the hold has not run out
        return await taker

    taken = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    assert [s.token_id for s in taken] == [2, 3, 4]


@pytest.mark.parametrize("error", [None, RuntimeError("the worker broke")])
def test_the_streams_end_cuts_a_hold_short(error):
    async def scenario():
        loop = asyncio.get_running_loop()
        buffer = StepBuffer()
        buffer.hold_until = loop.time() + 3600  # an hour: only the end can wake it
        taker = asyncio.ensure_future(buffer.take())
        await asyncio.sleep(0)
        buffer.put(step(7, 0, True, None))
        buffer.end(error)
        steps = await taker
        try:
            rest = await buffer.take()
        except RuntimeError as e:
            rest = e
        return steps, rest

    steps, rest = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    assert [s.token_id for s in steps] == [7]  # the last token goes out at once, an error after it
    assert rest == [] if error is None else rest is error


class GatedWorker:
    """The first token at once; then every token but the last, one per loop iteration, once `release` is set;
    the last (with the finish) once `finish` is set."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.release, self.finish = asyncio.Event(), asyncio.Event()
        self.sent = 0
        self.cancelled = False

    def open(self, work, timeout) -> StepStream:
        stream = StepStream()
        stream.cancel = lambda: setattr(self, "cancelled", True)
        asyncio.get_running_loop().create_task(self._produce(stream))
        return stream

    async def _produce(self, stream: StepStream) -> None:
        last = len(self.ids) - 1
        for index, token_id in enumerate(self.ids):
            if index == 1:
                await self.release.wait()
            if index == last:
                await self.finish.wait()
            stream.buffer.put(step(token_id, index, index == last, None))
            self.sent += 1
            await asyncio.sleep(0)
        stream.buffer.end()


def test_paced_streams_send_their_tokens_together_exactly_the_first_and_last_at_once(demo_tokenizer):
    """Three streams at 150 messages a second: each waits 20 ms after a message. The first token goes out
    alone and at once; the tokens of the wait go out as one message when it runs out; the last token,
    held back by the worker until then, goes out when it comes (a one-hour rate would show it waiting)."""
    ids = demo_tokenizer.encode(LONG_TEXT)[:40]

    async def one(core: GenerationCore, worker: GatedWorker):
        generation = core.generate(GenerationRequest(prompt="hi", max_tokens=len(ids)), RequestRecord("r"))
        first = await anext(generation)
        assert worker.sent == 1
        worker.release.set()
        second = await anext(generation)  # the hold ran out with every token but the last waiting
        assert worker.sent == len(ids) - 1
        core.pacing.message_rate = 3 / 3600  # from here a hold would last an hour: only the end may end it
        worker.finish.set()
        rest = [d async for d in generation]
        return [first, second, *rest]

    async def scenario():
        downstreams = FakeDownstreams(demo_tokenizer, ids)
        core = GenerationCore(downstreams, {}, message_rate=150)
        workers = [GatedWorker(ids) for _ in range(3)]
        opened = iter(workers)
        downstreams.open_worker_stream = lambda work, timeout: next(opened).open(work, timeout)
        results = await asyncio.gather(*(one(core, w) for w in workers))
        return results, core.pacing.open_streams

    results, still_open = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    assert still_open == 0
    for deltas in results:
        assert [len(d.token_ids) for d in deltas] == [1, len(ids) - 2, 1]
        assert [i for d in deltas for i in d.token_ids] == ids
        assert "".join(d.text for d in deltas) == reference_text(demo_tokenizer, ids)
        assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == len(ids)


def test_a_cancelled_paced_stream_is_no_longer_counted(demo_tokenizer):
    ids = demo_tokenizer.encode(LONG_TEXT)[:10]

    async def scenario():
        downstreams = FakeDownstreams(demo_tokenizer, ids)
        core = GenerationCore(downstreams, {}, message_rate=100)
        worker = GatedWorker(ids)
        downstreams.open_worker_stream = worker.open
        generation = core.generate(GenerationRequest(prompt="hi", max_tokens=len(ids)), RequestRecord("r"))
        await anext(generation)
        counted = core.pacing.open_streams
        await generation.aclose()  # the client went away
        return counted, core.pacing.open_streams, worker.cancelled

    assert asyncio.run(asyncio.wait_for(scenario(), WAIT_S)) == (1, 0, True)


def test_the_stream_message_rate_flag_is_5000_by_default_and_not_negative(capsys):
    assert gateway_args([]).stream_message_rate == 5000
    assert gateway_args(["--stream-message-rate", "0"]).stream_message_rate == 0
    with pytest.raises(SystemExit):
        gateway_args(["--stream-message-rate", "-1"])
    assert "--stream-message-rate must be >= 0, got -1" in capsys.readouterr().err
