"""Tokens that come faster than a message per token can go out are merged into one message, exactly.

A scripted worker sends the first token, waits until the client holds its message, then sends
every other token as fast as the event loop turns; the client reads slowly. The reference for the
text is tokenizers' own decode of the ids (Rust), not the gateway's incremental path.
"""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from gateway.core.deltas import Delta, joined_calls
from gateway.core.generation import GenerationCore
from gateway.core.metrics import RequestRecord
from gateway.core.validation import GenerationRequest
from gateway.fleet.step_stream import CallSteps, StepStream
from gateway.http_api.http_app import create_app
from gateway.http_api.http_server import HttpServer
from gateway.main import parse_args as gateway_args
from gateway.text.tool_parser import ToolCallDelta
from rpcserver.config import ServerConfig
from tests.integration.stack import free_port
from tests.unit.test_generation_core import TEXT, FakeDownstreams
from tests.unit.test_tool_calls_api import gateway_stub
from vllm_v0.gateway.v1 import gateway_pb2
from vllm_v0.worker.v1 import worker_pb2

WAIT_S = 10.0  # bounded waits on conditions, never a measure of speed
LONG_TEXT = (TEXT + " and a few more plain words to make it longer. ") * 6


def step(token_id: int, index: int, last: bool, top: int | None) -> worker_pb2.GenerateResponse:
    message = worker_pb2.GenerateResponse(token_id=token_id)
    if top is not None:
        message.logprob = -0.25 - index
        message.top_logprobs.extend(worker_pb2.TokenLogprob(token_id=token_id + k + 1, logprob=-5.0 - k)
                                    for k in range(top))
    if last:
        message.finish_reason = worker_pb2.FINISH_REASON_LENGTH
    return message


class ScriptedWorker:
    """Opens request streams whose first token comes at once and the rest once `release()` is called, one
    per loop iteration (a worker far faster than a message per token)."""

    def __init__(self, ids: list[int], per_turn: int = 1):
        self.ids = ids
        self.per_turn = per_turn
        self.released = asyncio.Event()
        self.sent = 0  # tokens produced so far
        self.cancelled = False

    def open(self, work: worker_pb2.GenerateRequest, timeout) -> StepStream:
        stream = StepStream()
        stream.cancel = self._cancel
        top = work.logprobs if work.HasField("logprobs") else None
        asyncio.get_running_loop().create_task(self._produce(stream, top))
        return stream

    def _cancel(self) -> None:
        self.cancelled = True

    async def _produce(self, stream: StepStream, top: int | None) -> None:
        last = len(self.ids) - 1
        for index, token_id in enumerate(self.ids):
            if index == 1:
                await self.released.wait()
            stream.buffer.put(step(token_id, index, index == last, top))
            self.sent += 1
            if index % self.per_turn == 0:
                await asyncio.sleep(0)
        stream.buffer.end()

    def release(self) -> None:
        self.released.set()


def serving(demo_tokenizer, ids: list[int], per_turn: int = 1) -> tuple[FakeDownstreams, ScriptedWorker]:
    downstreams = FakeDownstreams(demo_tokenizer, ids)
    worker = ScriptedWorker(ids, per_turn)
    downstreams.open_worker_stream = worker.open
    return downstreams, worker


def reference_text(demo_tokenizer, ids: list[int]) -> str:
    return demo_tokenizer.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_slow_reader_gets_every_token_in_fewer_deltas_the_first_at_once(demo_tokenizer):
    ids = demo_tokenizer.encode(LONG_TEXT)
    downstreams, worker = serving(demo_tokenizer, ids)
    core = GenerationCore(downstreams, {})

    async def read():
        generation = core.generate(GenerationRequest(prompt="hi", max_tokens=len(ids), logprobs=2),
                                   RequestRecord("r"), with_pieces=True)
        first = await anext(generation)
        produced_at_first = worker.sent
        worker.release()
        rest = []
        async for delta in generation:
            rest.append(delta)
            await asyncio.sleep(0.002)  # a slow client
        return first, produced_at_first, rest

    first, produced_at_first, rest = asyncio.run(asyncio.wait_for(read(), WAIT_S))
    deltas = [first, *rest]
    assert produced_at_first == 1 and first.token_ids == ids[:1]  # the first token was not held back
    assert len(deltas) < len(ids) / 2 and max(len(d.token_ids) for d in deltas) > 1
    assert [i for d in deltas for i in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == reference_text(demo_tokenizer, ids)
    for d in deltas:  # a merged delta carries every one of its tokens' logprobs, in order
        assert [lp.chosen.token_id for lp in d.logprobs] == d.token_ids
        assert all([t.token_id for t in lp.top] == [lp.chosen.token_id + 1, lp.chosen.token_id + 2]
                   for lp in d.logprobs)
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert [lp.chosen.logprob for lp in logprobs] == [-0.25 - i for i in range(len(ids))]
    assert b"".join(lp.chosen.piece for lp in logprobs).decode() == reference_text(demo_tokenizer, ids)
    assert [d.completion_tokens for d in deltas] == [sum(len(e.token_ids) for e in deltas[:k + 1])
                                                     for k in range(len(deltas))]
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == len(ids)


@pytest.mark.parametrize("stop", ["日本", "more words", "🚀 and"])
def test_a_stop_string_inside_merged_tokens_ends_at_the_token_that_completed_it(demo_tokenizer, stop):
    """The same ids taken one per message and all at once: the same text, tokens and counts."""
    ids = demo_tokenizer.encode(LONG_TEXT)
    request = GenerationRequest(prompt="hi", max_tokens=len(ids), stop=[stop])

    async def read(downstreams) -> list[Delta]:
        return [d async for d in GenerationCore(downstreams, {}).generate(request, RequestRecord("r"))]

    step_by_step = FakeDownstreams(demo_tokenizer, ids)
    one_by_one = asyncio.run(asyncio.wait_for(read(step_by_step), WAIT_S))
    downstreams, worker = serving(demo_tokenizer, ids, per_turn=len(ids))
    worker.release()
    merged = asyncio.run(asyncio.wait_for(read(downstreams), WAIT_S))

    assert max(len(d.token_ids) for d in one_by_one) == 1 and len(merged) <= 2
    assert step_by_step.streams[0].cancelled and worker.cancelled  # the worker is stopped at the stop string
    full = reference_text(demo_tokenizer, ids)
    for deltas in (one_by_one, merged):
        assert "".join(d.text for d in deltas) == full[:full.index(stop)]
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", stop)
    assert [i for d in merged for i in d.token_ids] == [i for d in one_by_one for i in d.token_ids]
    assert merged[-1].completion_tokens == one_by_one[-1].completion_tokens < len(ids)


def test_stream_interval_holds_tokens_until_that_many_but_never_the_first_or_the_last(demo_tokenizer):
    ids = demo_tokenizer.encode(LONG_TEXT)[:23]
    downstreams = FakeDownstreams(demo_tokenizer, ids)  # a step at a time: the reader keeps up

    async def read():
        return [d async for d in GenerationCore(downstreams, {}, stream_interval=5).generate(
            GenerationRequest(prompt="hi", max_tokens=len(ids)), RequestRecord("r"))]

    deltas = asyncio.run(asyncio.wait_for(read(), WAIT_S))
    assert [len(d.token_ids) for d in deltas] == [1, 5, 5, 5, 5, 2]
    assert [i for d in deltas for i in d.token_ids] == ids
    assert "".join(d.text for d in deltas) == reference_text(demo_tokenizer, ids)
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == len(ids)


def test_the_stream_interval_flag_is_one_by_default_and_at_least_one(capsys):
    assert gateway_args([]).stream_interval == 1 and gateway_args(["--stream-interval", "8"]).stream_interval == 8
    with pytest.raises(SystemExit):
        gateway_args(["--stream-interval", "0"])
    assert "--stream-interval must be >= 1, got 0" in capsys.readouterr().err


def test_a_generate_call_is_read_in_batches_while_its_reader_is_busy():
    """The per-request path (--worker-stream per-request): a task reads the call, the reader takes all."""
    class Call:
        def __init__(self):
            self.cancelled = False

        def __aiter__(self):
            return self._steps()

        async def _steps(self):
            for i in range(40):
                yield step(i + 10, i, i == 39, None)
                await asyncio.sleep(0)

        def cancel(self):
            self.cancelled = True

    async def read():
        batches = []
        async for batch in CallSteps(Call()).batches():
            batches.append([s.token_id for s in batch])
            await asyncio.sleep(0.002)
        return batches

    batches = asyncio.run(asyncio.wait_for(read(), WAIT_S))
    assert [t for b in batches for t in b] == list(range(10, 50)) and len(batches) < 20


def test_merged_tool_call_pieces_keep_one_piece_per_call():
    calls = [ToolCallDelta(0, "call_a", "f", '{"x"'), ToolCallDelta(0, arguments=": 1}"),
             ToolCallDelta(1, "call_b", "g", ""), ToolCallDelta(1, arguments="{}")]
    joined = joined_calls(calls)
    assert [(c.index, c.id, c.name, c.arguments) for c in joined] == [
        (0, "call_a", "f", '{"x": 1}'), (1, "call_b", "g", "{}")]


def test_the_grpc_client_gets_fewer_messages_than_tokens_and_exact_ids_and_text(demo_tokenizer):
    ids = demo_tokenizer.encode(LONG_TEXT)
    downstreams, worker = serving(demo_tokenizer, ids)

    async def run():
        async with gateway_stub(downstreams) as stub:
            call = stub.Generate(gateway_pb2.GenerateRequest(prompt="hi", max_tokens=len(ids),
                                                             request_id="slow-reader"))
            first = await call.read()
            produced_at_first = worker.sent
            worker.release()
            replies = [first]
            while (reply := await call.read()) is not grpc.aio.EOF:
                replies.append(reply)
                await asyncio.sleep(0.002)
            return produced_at_first, replies

    produced_at_first, replies = asyncio.run(asyncio.wait_for(run(), WAIT_S))
    assert produced_at_first == 1 and list(replies[0].token_ids) == ids[:1]
    assert replies[0].request_id == "slow-reader" and replies[-1].request_id == "slow-reader"
    assert len(replies) < len(ids) / 2
    assert [i for r in replies for i in r.token_ids] == ids
    assert "".join(r.text for r in replies) == reference_text(demo_tokenizer, ids)
    assert replies[-1].usage.completion_tokens == len(ids)


def test_an_sse_event_carries_several_tokens_with_all_their_logprobs_in_order(demo_tokenizer):
    """Chat over the real HTTP server: a chunk's `logprobs.content` lists each of its tokens."""
    ids = demo_tokenizer.encode(LONG_TEXT)
    downstreams, worker = serving(demo_tokenizer, ids)
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": len(ids),
                       "stream": True, "logprobs": True, "top_logprobs": 1}).encode()

    async def run():
        app = create_app(GenerationCore(downstreams, {}), lambda: "m", lambda: True, None, 1 << 20)
        config = ServerConfig("127.0.0.1", 0, 1.0, 1 << 22, None, None, None, "warning")
        http = HttpServer(app, config, free_port(), "warning")
        await http.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            events = []
            while line := await reader.readline():
                if line.startswith(b"data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        assert worker.sent == 1  # the first event went out before the rest were produced
                        worker.release()
                    await asyncio.sleep(0.002)
            writer.close()
            return events
        finally:
            await downstreams.detokenizer.close()
            await http.stop()

    events = asyncio.run(asyncio.wait_for(run(), WAIT_S))
    content = [e["choices"][0]["logprobs"]["content"] for e in events]
    assert len(content[0]) == 1 and len(events) < len(ids) / 2 and max(len(c) for c in content) > 1
    entries = [entry for c in content for entry in c]
    assert [entry["logprob"] for entry in entries] == [-0.25 - i for i in range(len(ids))]
    assert bytes(b for entry in entries for b in entry["bytes"]).decode() == reference_text(demo_tokenizer, ids)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        reference_text(demo_tokenizer, ids)
