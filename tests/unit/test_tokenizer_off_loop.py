"""TokenizerService keeps its event loop free while it encodes or decodes a huge input (real grpc.aio server, port 0)."""
from __future__ import annotations

import asyncio
import threading

from services.tokenizer.core import TokenizerCore
from tests.unit.test_decode_stream import with_server
from vllm_v0.tokenizer.v1 import tokenizer_pb2

# 1M CJK characters (3 MB of UTF-8, under the gateway's body limit): seconds of encoding.
HUGE_TEXT = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(1_000_000))


class SignallingCore(TokenizerCore):
    """The real core, saying when it begins a long encode or decode and adding "computed" to `events` when
    the work itself is done (on whatever thread runs it).

    With `hold`, a long decode first waits until the test releases it (10 s at most): the small calls
    must finish in that time, which they can only do while the loop is free.
    """

    started = threading.Event()
    released = threading.Event()
    events: list[str] = []
    hold = False

    def encode(self, text, add_special_tokens=False):
        if len(text) <= 1000:
            return super().encode(text, add_special_tokens)
        self.started.set()
        ids = super().encode(text, add_special_tokens)
        self.events.append("computed")
        return ids

    def _decode(self, ids, skip_special_tokens):  # what every decode, whole or incremental, runs
        if len(ids) <= 1000:
            return super()._decode(ids, skip_special_tokens)
        self.started.set()
        if self.hold:
            self.released.wait(10)
        text = super()._decode(ids, skip_special_tokens)
        self.events.append("computed")
        return text


async def wait_until(event: threading.Event) -> None:
    # Polled on the loop: while the loop is blocked by the long call, this cannot run either.
    while not event.is_set():
        await asyncio.sleep(0.001)


async def finish_order(big, small_calls) -> list[str]:
    """Start `big`, then once it runs, the small calls: the order in which they all finish, with the
    moment the big one's work was done ("computed") among them."""
    order = SignallingCore.events

    async def run(name, call):
        await call
        order.append(name)

    big_task = asyncio.ensure_future(run("big", big))
    await wait_until(SignallingCore.started)
    # The worker thread has set `started` and is about to call into the tokenizer's native code; the loop
    # gives up the GIL here so that it does. A call that kept the GIL would keep this sleep from ending.
    await asyncio.sleep(0.05)
    await asyncio.gather(*(run(name, call) for name, call in small_calls))
    SignallingCore.released.set()
    await big_task
    return order


def new_core(demo_tokenizer_dir, hold: bool) -> SignallingCore:
    core = SignallingCore.from_dir(demo_tokenizer_dir)
    core.hold = hold
    core.started.clear()
    core.released.clear()
    core.events.clear()
    return core


def test_small_calls_finish_while_a_huge_encode_runs(demo_tokenizer_dir):
    """The real encode of 1M characters, seconds long: the small calls finish while it computes, so it leaves
    both the loop and the GIL to them."""
    core = new_core(demo_tokenizer_dir, hold=False)

    async def body(stub):
        return await finish_order(stub.Encode(tokenizer_pb2.EncodeRequest(text=HUGE_TEXT)), [
            ("encode", stub.Encode(tokenizer_pb2.EncodeRequest(text="hello"))),
            ("info", stub.GetInfo(tokenizer_pb2.GetInfoRequest())),
            ("chat", stub.Encode(tokenizer_pb2.EncodeRequest(messages=[
                tokenizer_pb2.ChatMessage(role="user", content="hi")])))])

    order = asyncio.run(with_server(core, body))
    assert order[-2:] == ["computed", "big"] and sorted(order) == ["big", "chat", "computed", "encode", "info"]


def test_small_calls_finish_while_a_long_decode_runs(demo_tokenizer, demo_tokenizer_dir):
    ids = demo_tokenizer.encode(HUGE_TEXT[:100_000])
    core = new_core(demo_tokenizer_dir, hold=True)

    async def body(stub):
        big = stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids))
        return await finish_order(big, [("decode", stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids[:5]))),
                                        ("info", stub.GetInfo(tokenizer_pb2.GetInfoRequest()))])

    order = asyncio.run(with_server(core, body))
    assert order[-2:] == ["computed", "big"] and sorted(order) == ["big", "computed", "decode", "info"]


def test_a_long_decode_stream_message_leaves_the_loop_free(demo_tokenizer, demo_tokenizer_dir):
    ids = demo_tokenizer.encode(HUGE_TEXT[:100_000])
    core = new_core(demo_tokenizer_dir, hold=True)

    async def body(stub):
        stream = stub.DecodeBatches()

        async def big():
            await stream.write(tokenizer_pb2.DecodeBatchRequest(items=[
                tokenizer_pb2.DecodeBatchItem(stream_id=1, token_ids=ids, final=True)]))
            reply = await stream.read()
            await stream.done_writing()
            return reply

        return await finish_order(big(), [("decode", stub.Decode(tokenizer_pb2.DecodeRequest(token_ids=ids[:5])))])

    order = asyncio.run(with_server(core, body))
    assert order == ["decode", "computed", "big"]
