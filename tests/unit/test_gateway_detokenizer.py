"""The gateway's Detokenizer over a fake DecodeBatches call (no sockets): batching, text, failures, cancel."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from demo.vocab import load_ranks, ranks_path
from gateway.text.detokenize import Detokenizer
from rpcserver.errors import Unavailable
from tests.unit.test_generation_core import FakeBatchCall, settle

TEXTS = ["Party 🦜🤗 中文分词 <|im_end|> done", "日本語のテキスト 🎉🚀 then words", "🦜🦜 plain", "short",
         "Emoji 🎉🚀 and 日本語 mixed, then more words"]


class MortalCall(FakeBatchCall):
    """Answers like the service until `die`; held messages get no reply, as when the service is killed mid-step."""

    def __init__(self, core):
        super().__init__(core)
        self.hold = False
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def write(self, request):
        if self.status is not None:
            raise asyncio.InvalidStateError("RPC already finished")
        if self.hold:
            self.requests.append(request)
        else:
            await super().write(request)

    async def read(self):
        reply = await self.replies.get()
        if isinstance(reply, grpc.aio.AioRpcError):
            raise reply
        return reply

    def die(self, code=grpc.StatusCode.UNAVAILABLE, details="Socket closed") -> None:
        self.status = (code, details)
        self.replies.put_nowait(grpc.aio.AioRpcError(code, details=details))


class Stub:
    def __init__(self, core):
        self.core = core
        self.calls: list[MortalCall] = []

    def DecodeBatches(self, timeout=None):
        self.calls.append(MortalCall(self.core))
        return self.calls[-1]


def test_one_iteration_of_adds_is_one_message_and_each_stream_gets_its_own_text(demo_tokenizer):
    texts = [TEXTS[i % len(TEXTS)] for i in range(16)]
    ids = [demo_tokenizer.encode(t) for t in texts]
    skip = [i % 2 == 0 for i in range(16)]

    async def stream(detokenizer, n):
        text_stream = detokenizer.open(skip[n])
        deltas = []
        for i, token_id in enumerate(ids[n]):
            text, _ = await text_stream.add([token_id], final=i == len(ids[n]) - 1)
            deltas.append(text)
        return deltas

    async def main():
        detokenizer = Detokenizer(Stub(demo_tokenizer))
        deltas = await asyncio.gather(*(stream(detokenizer, n) for n in range(16)))
        return detokenizer.stub.calls, deltas

    calls, deltas = asyncio.run(main())
    assert len(calls) == 1
    (call,) = calls
    # Every stream's first add went out in the first message, and each later step's adds together.
    assert [len(r.items) for r in call.requests[:1]] == [16]
    assert len({item.stream_id for item in call.requests[0].items}) == 16
    assert len(call.requests) == max(len(i) for i in ids)
    for n in range(16):
        assert "".join(deltas[n]) == demo_tokenizer.decode(ids[n], skip_special_tokens=skip[n])
        assert not any("\ufffd" in d for d in deltas[n])
    assert call.state.streams == {}


def test_pieces_come_back_per_add(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXTS[0])

    async def main():
        detokenizer = Detokenizer(Stub(demo_tokenizer))
        a, b = detokenizer.open(True), detokenizer.open(True)
        return await asyncio.gather(a.add(ids, True, ids[:2]), b.add(ids[:3], False, ids[2:3]))

    (text_a, pieces_a), (text_b, pieces_b) = asyncio.run(main())
    id_bytes = {rank: token for token, rank in load_ranks(ranks_path()).items()}  # rank = id in Qwen's vocabulary
    assert text_a == demo_tokenizer.decode(ids, skip_special_tokens=True)
    assert pieces_a == [id_bytes[i] for i in ids[:2]] and pieces_b == [id_bytes[ids[2]]]
    # b's ids end inside 🦜 (its last byte is in ids[3]): its text waits for the rest of the character.
    assert text_b == "" and b"".join([*pieces_a, *pieces_b]) == "Party 🦜".encode()[:-1]


def test_a_failed_call_fails_every_waiting_add_and_the_next_open_starts_another(demo_tokenizer):
    ids = demo_tokenizer.encode("hello there")

    async def main():
        detokenizer = Detokenizer(Stub(demo_tokenizer))
        streams = [detokenizer.open(False) for _ in range(4)]
        await asyncio.gather(*(s.add(ids[:1]) for s in streams))
        first = detokenizer.stub.calls[0]
        first.hold = True  # the service takes the next message, then dies before answering it
        waiting = [asyncio.ensure_future(s.add(ids[1:2])) for s in streams[:3]]
        await settle(detokenizer)
        first.die()
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        with pytest.raises(Unavailable, match="UNAVAILABLE: Socket closed") as later:
            await streams[3].add(ids[1:2])  # its state died with the call
        fresh = detokenizer.open(False)
        text, _ = await fresh.add(ids, final=True)
        return outcomes, later.value, detokenizer.stub.calls, text

    # Bounded: an add the failure did not reach would otherwise wait forever.
    outcomes, later, calls, text = asyncio.run(asyncio.wait_for(main(), 30))
    assert len(outcomes) == 3 and all(isinstance(o, Unavailable) for o in outcomes)
    assert all("tokenizer service ended the DecodeBatches call (UNAVAILABLE: Socket closed)" in str(o)
               for o in outcomes)
    assert len(calls) == 2 and calls[0].cancelled and not calls[1].cancelled
    assert text == "hello there"


def test_a_call_that_ended_between_messages_is_unavailable(demo_tokenizer):
    async def main():
        detokenizer = Detokenizer(Stub(demo_tokenizer))
        stream = detokenizer.open(False)
        await stream.add([1])
        call = detokenizer.stub.calls[0]
        call.status = (grpc.StatusCode.UNAVAILABLE, "Socket closed")  # the next write finds it over
        call.code = lambda: asyncio.sleep(0, grpc.StatusCode.UNAVAILABLE)
        call.details = lambda: asyncio.sleep(0, "Socket closed")
        with pytest.raises(Unavailable, match=r"\(UNAVAILABLE: Socket closed\); retry"):
            await stream.add([2])

    asyncio.run(asyncio.wait_for(main(), 30))


def test_cancel_sends_close_for_an_unfinished_stream_only(demo_tokenizer):
    ids = demo_tokenizer.encode("🦜 flies")

    async def main():
        detokenizer = Detokenizer(Stub(demo_tokenizer))
        unfinished, finished, unused = (detokenizer.open(False) for _ in range(3))
        await asyncio.gather(unfinished.add(ids[:1]), finished.add(ids, final=True))
        for stream in (unfinished, finished, unused):
            stream.cancel()
        await settle(detokenizer)
        # The close got no reply, and did not throw the order of replies off for later adds.
        after = detokenizer.open(False)
        text, _ = await after.add(ids, final=True)
        return detokenizer.stub.calls[0], unfinished.stream_id, text

    call, unfinished_id, text = asyncio.run(main())
    assert call.closed == [unfinished_id]
    assert [item.close for item in call.requests[1].items] == [True]
    assert call.state.streams == {} and text == "🦜 flies"


def test_a_refused_item_fails_its_stream_and_the_others_go_on(demo_tokenizer):
    """An id the service refuses fails that generation's add with the service's status; the shared call stays."""
    ids = demo_tokenizer.encode(TEXTS[1])

    async def good(detokenizer):
        text_stream = detokenizer.open(False)
        return "".join([(await text_stream.add([t], final=i == len(ids) - 1))[0] for i, t in enumerate(ids)])

    async def bad(detokenizer):
        text_stream = detokenizer.open(False)
        await text_stream.add(ids[:2])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await text_stream.add([10**9])
        return refused.value

    async def main():
        detokenizer = Detokenizer(Stub(demo_tokenizer))
        text, error = await asyncio.gather(good(detokenizer), bad(detokenizer))
        return detokenizer.stub.calls, text, error

    calls, text, error = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in error.details()
    assert text == TEXTS[1]
    assert len(calls) == 1 and calls[0].status is None  # one call throughout, never ended
