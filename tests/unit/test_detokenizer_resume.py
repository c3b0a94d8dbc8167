"""Text streams outlive their DecodeBatches call: broken mid-stream, re-primed on a new one, the text still exact."""
from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace

import grpc
import pytest

from demo.vocab import load_ranks, ranks_path
from gateway.text.detokenize import Detokenizer
from gateway.text.stream_history import StreamHistory
from rpcserver.errors import Unavailable
from services.tokenizer.byte_level import BYTE_LEVEL
from tests.unit.test_gateway_detokenizer import TEXTS, MortalCall

WAIT_S = 30.0  # bounds a test that would otherwise hang; never a measure of speed


def policy(max_resumes: int = 3, wait_s: float = 5.0) -> SimpleNamespace:
    return SimpleNamespace(max_resumes=max_resumes, wait_s=wait_s)


class BreakingCall(MortalCall):
    """Dies once `die_at` messages have come: that one goes unanswered, as when the service is killed mid-step."""

    def __init__(self, core, die_at: int | None, on_die):
        super().__init__(core)
        self.die_at, self.on_die = die_at, on_die

    async def write(self, request):
        if self.die_at is not None and len(self.requests) + 1 == self.die_at and self.status is None:
            self.hold = True
            self.on_die()
            asyncio.get_running_loop().call_soon(self.die)
        await super().write(request)


class Tokenizers:
    """DecodeBatches on the real tokenizer core; the n-th call dies at its `die_at[n]`-th message (None: never)."""

    def __init__(self, core, die_at=(), on_die=lambda: None):
        self.core, self.die_at, self.on_die = core, list(die_at), on_die
        self.calls: list[BreakingCall] = []

    def DecodeBatches(self, timeout=None):
        n = len(self.calls)
        self.calls.append(BreakingCall(self.core, self.die_at[n] if n < len(self.die_at) else None, self.on_die))
        return self.calls[-1]

    async def reopen(self, wait_s: float):
        await asyncio.sleep(0)
        return self.DecodeBatches(), f"tokenizer-{len(self.calls)}"


def byte_ids(core, text: str) -> list[int]:
    """An id per UTF-8 byte of `text` (byte-level tokens): every character past ASCII split across 2-4 ids."""
    to_char = {byte: char for char, byte in BYTE_LEVEL.items()}
    return [core.tokenizer.token_to_id(to_char[b]) for b in text.encode()]


def piece_bytes() -> dict[int, bytes]:
    return {rank: token for token, rank in load_ranks(ranks_path()).items()}  # rank = id in Qwen's vocabulary


async def generate(detokenizer: Detokenizer, ids: list[int], skip: bool, chunks: list[int], pieces: bool,
                   each: bool, opened: list) -> tuple[str, list[bytes]]:
    """A stream's text and pieces, its ids added in `chunks` (sizes), as the generation core adds them."""
    stream = detokenizer.open(skip)
    opened.append(stream)
    texts, got, at = [], [], 0
    for n, size in enumerate(chunks):
        chunk, final = ids[at:at + size], n == len(chunks) - 1
        at += size
        if each:
            text, piece = await stream.add_each(chunk, final, chunk if pieces else [])
            texts.extend(text)
        else:
            text, piece = await stream.add(chunk, final, chunk if pieces else [])
            texts.append(text)
        got.extend(piece)
    return "".join(texts), got


def chunking(rng: random.Random, length: int) -> list[int]:
    sizes = []
    while sum(sizes) < length:
        sizes.append(min(rng.choice([1, 1, 1, 2, 3]), length - sum(sizes)))
    return sizes


@pytest.mark.parametrize("pieces", [False, True])
def test_streams_go_on_over_two_breaks_with_exactly_the_text_of_a_one_shot_decode(demo_tokenizer, pieces):
    rng = random.Random(7)
    texts = [*TEXTS, "x" * 20 + " 中文分词 🦜🤗 " * 3, "日本語のテキスト 🎉🚀" * 2]
    # Half the streams in byte-level ids: a character is held back across several adds, at any break.
    ids = [demo_tokenizer.encode(t) if n % 2 else byte_ids(demo_tokenizer, t) for n, t in enumerate(texts)]
    assert demo_tokenizer.decode(ids[2]) == texts[2]
    skip = [n % 3 == 0 for n in range(len(texts))]
    chunks = [chunking(rng, len(i)) for i in ids]
    held_at_break: list[bool] = []
    opened: list = []
    reprimed = []

    def on_die():  # a character split across tokens is being held by some stream when the call dies
        held_at_break.append(any(s.history.unsettled and not s.finished for s in opened))

    async def main():
        tokenizers = Tokenizers(demo_tokenizer, die_at=[6, 9], on_die=on_die)
        detokenizer = Detokenizer(tokenizers, resume=policy(), reopen=tokenizers.reopen,
                                  on_reprime=lambda: reprimed.append(1))
        results = await asyncio.gather(*(generate(detokenizer, ids[n], skip[n], chunks[n], pieces, n % 4 == 1, opened)
                                         for n in range(len(texts))))
        return tokenizers.calls, results

    calls, results = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert len(calls) == 3 and [c.status is not None for c in calls] == [True, True, False]
    assert held_at_break == [True, True]
    id_bytes = piece_bytes()
    for n, (text, got) in enumerate(results):
        assert text == demo_tokenizer.decode(ids[n], skip_special_tokens=skip[n]), n
        assert got == ([id_bytes[i] for i in ids[n]] if pieces else [])
    # Every stream open at a break went on re-primed; each at most once per break.
    assert 0 < len(reprimed) <= 2 * len(texts)
    assert calls[2].state.streams == {}  # every stream ended with its final item on the last call


def test_a_prime_reproduces_a_held_character_past_the_services_flush_window(demo_tokenizer):
    """20 ids of text, then the first byte of 中 held back; the call dies with the second byte in flight."""
    ids = byte_ids(demo_tokenizer, "x" * 20 + "中文 🦜")

    async def main():
        tokenizers = Tokenizers(demo_tokenizer, die_at=[22])
        detokenizer = Detokenizer(tokenizers, resume=policy(), reopen=tokenizers.reopen)
        stream, deltas = detokenizer.open(False), []
        for n, token_id in enumerate(ids):
            deltas.append((await stream.add([token_id], n == len(ids) - 1))[0])
        return tokenizers.calls, deltas

    calls, deltas = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert "".join(deltas) == "x" * 20 + "中文 🦜" and deltas[20:23] == ["", "", "中"]
    # On the new call: the 20 decoded ids as one item, the held byte as it went, then the add that was in flight.
    first = calls[1].requests[0].items
    assert [list(item.token_ids) for item in first] == [ids[:20], ids[20:21], ids[21:22]]
    assert first[0].skip_special_tokens is False and not any(item.final for item in first)


def test_an_add_each_in_flight_goes_again_item_by_item(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXTS[0])

    async def main():
        tokenizers = Tokenizers(demo_tokenizer, die_at=[2])
        detokenizer = Detokenizer(tokenizers, resume=policy(), reopen=tokenizers.reopen)
        stream = detokenizer.open(True)
        first, _ = await stream.add_each(ids[:3])
        rest, pieces = await stream.add_each(ids[3:], True, ids[3:5])
        return first + rest, pieces

    texts, pieces = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert len(texts) == len(ids) and "".join(texts) == demo_tokenizer.decode(ids, skip_special_tokens=True)
    assert pieces == [piece_bytes()[i] for i in ids[3:5]]


def test_a_refused_stream_is_not_reprimed_and_the_others_go_on(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXTS[1])
    broken = asyncio.Event()

    async def good(detokenizer):
        stream, deltas = detokenizer.open(False), []
        for n, token_id in enumerate(ids):
            if n == 4:
                await broken.wait()
            deltas.append((await stream.add([token_id], n == len(ids) - 1))[0])
        return "".join(deltas)

    async def refused(detokenizer, tokenizers):
        stream = detokenizer.open(False)
        await stream.add(ids[:2])
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stream.add([10**9])
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        tokenizers.calls[0].die()
        await asyncio.sleep(0.01)
        broken.set()
        with pytest.raises(Unavailable, match="ended the DecodeBatches call"):
            await stream.add(ids[2:3])

    async def main():
        tokenizers = Tokenizers(demo_tokenizer)
        reprimed = []
        detokenizer = Detokenizer(tokenizers, resume=policy(), reopen=tokenizers.reopen,
                                  on_reprime=lambda: reprimed.append(1))
        text, _ = await asyncio.gather(good(detokenizer), refused(detokenizer, tokenizers))
        return text, reprimed, tokenizers.calls

    text, reprimed, calls = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert text == TEXTS[1] and reprimed == [1] and len(calls) == 2


def test_a_stream_goes_on_at_most_max_resumes_times(demo_tokenizer):
    ids = demo_tokenizer.encode("hello there, a few more words")

    async def main():
        tokenizers = Tokenizers(demo_tokenizer, die_at=[2, 2, 2])
        detokenizer = Detokenizer(tokenizers, resume=policy(max_resumes=2), reopen=tokenizers.reopen)
        stream = detokenizer.open(False)
        for token_id in ids:
            await stream.add([token_id])

    with pytest.raises(Unavailable, match=r"ended the DecodeBatches call \(UNAVAILABLE: Socket closed\)"):
        asyncio.run(asyncio.wait_for(main(), WAIT_S))


def test_no_tokenizer_serving_within_the_wait_fails_the_add_saying_so(demo_tokenizer):
    waited = []

    async def none_serving(wait_s: float):
        waited.append(wait_s)
        raise Unavailable(f"no tokenizer service is serving (waited {wait_s:g} s); retry shortly")

    async def main():
        tokenizers = Tokenizers(demo_tokenizer, die_at=[2])
        detokenizer = Detokenizer(tokenizers, resume=policy(wait_s=0.5), reopen=none_serving)
        streams = [detokenizer.open(False) for _ in range(3)]
        await asyncio.gather(*(s.add([9707]) for s in streams))
        return await asyncio.gather(*(s.add([1879]) for s in streams), return_exceptions=True)

    outcomes = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert all(isinstance(o, Unavailable) and "no tokenizer service is serving (waited 0.5 s)" in str(o)
               for o in outcomes)
    assert waited == [0.5]  # one wait for the three streams


def test_the_new_call_is_logged_once_naming_its_tokenizer(demo_tokenizer, caplog):
    ids = demo_tokenizer.encode(TEXTS[4])

    async def one(detokenizer):
        stream = detokenizer.open(False)
        return "".join([(await stream.add([t], n == len(ids) - 1))[0] for n, t in enumerate(ids)])

    async def main():
        tokenizers = Tokenizers(demo_tokenizer, die_at=[3])
        detokenizer = Detokenizer(tokenizers, resume=policy(), reopen=tokenizers.reopen)
        return await asyncio.gather(*(one(detokenizer) for _ in range(6)))

    with caplog.at_level(logging.WARNING, logger="gateway.text.detokenize"):
        texts = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert texts == [TEXTS[4]] * 6
    lines = [r.getMessage() for r in caplog.records if "new call" in r.getMessage()]
    assert len(lines) == 1 and "tokenizer-2" in lines[0] and "UNAVAILABLE: Socket closed" in lines[0]


@pytest.mark.parametrize("primed, delivered, after, shown", [
    ("abc", "abc", ["d"], ["d"]),                 # the usual prime: the same text
    ("abcXY", "abc", ["d"], ["XYd"]),             # more: the extra goes out with the next delta
    ("a", "abc", ["b", "cd", "e"], ["", "d", "e"]),  # less: what was delivered is cut from what comes next
])
def test_text_after_a_prime_is_reconciled_with_the_text_delivered(primed, delivered, after, shown):
    history = StreamHistory()
    history.deliver([delivered])
    history.primed([primed])
    assert [history.deliver([text])[0] for text in after] == shown
    assert "".join(history.text) == delivered + "".join(shown)


def test_text_after_a_prime_that_contradicts_the_text_delivered_fails():
    history = StreamHistory()
    history.deliver(["abc"])
    with pytest.raises(Unavailable, match="other text"):
        history.primed(["abX"])
    history.primed(["a"])
    with pytest.raises(Unavailable, match="differs"):
        history.deliver(["bX"])
