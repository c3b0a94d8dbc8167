"""TokenizerService.DecodeBatches in-process on a real grpc.aio server: many streams on one call, each as if alone."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from demo.vocab import load_ranks, ranks_path
from rpcserver.errors import ResourceExhausted
from services.tokenizer.decode_batches import DecodeBatchState, StreamLimits
from services.tokenizer.decode_stream import MAX_HELD_IDS, DecodeStreamState
from tests.unit.test_decode_stream import status_after, with_server
from vllm_v0.tokenizer.v1 import tokenizer_pb2

IM_END = 151645
TEXTS = ["Party 🦜🤗 中文分词 <|im_end|> done", "日本語のテキスト 🎉🚀 then <|im_end|> words",
         "🦜🦜 plain", "short"]


def item(stream_id, token_ids=(), **fields):
    return tokenizer_pb2.DecodeBatchItem(stream_id=stream_id, token_ids=token_ids, **fields)


async def exchange(stub, messages: list[list[tokenizer_pb2.DecodeBatchItem]]):
    """Each message's reply, then the call's status."""
    call, replies = stub.DecodeBatches(), []
    for items in messages:
        await call.write(tokenizer_pb2.DecodeBatchRequest(items=items))
        replies.append(await call.read())
    await call.done_writing()
    return replies, await call.code()


def interleaved(streams: dict[int, list[int]], skip: dict[int, bool]) -> list[list[tokenizer_pb2.DecodeBatchItem]]:
    """Round-robin messages: stream k sends k+1 ids per message (so streams end at different steps)."""
    sent = {s: 0 for s in streams}
    messages = []
    while any(sent[s] < len(ids) for s, ids in streams.items()):
        items = []
        for s, ids in streams.items():
            if sent[s] >= len(ids):
                continue
            chunk = ids[sent[s]:sent[s] + s + 1]
            # The flag on later items differs on purpose: only a stream's first item may set it.
            items.append(item(s, chunk, final=sent[s] + len(chunk) == len(ids),
                              skip_special_tokens=skip[s] if sent[s] == 0 else not skip[s]))
            sent[s] += len(chunk)
        messages.append(items)
    return messages


def test_interleaved_streams_each_decode_as_alone(demo_tokenizer):
    streams = {s: demo_tokenizer.encode(text) for s, text in enumerate(TEXTS)}
    skip = {0: True, 1: False, 2: True, 3: False}
    messages = interleaved(streams, skip)

    replies, code = asyncio.run(with_server(demo_tokenizer, lambda stub: exchange(stub, messages)))
    assert code == grpc.StatusCode.OK
    assert len(replies) == len(messages)
    deltas = {s: [] for s in streams}
    for items, reply in zip(messages, replies):
        assert [r.stream_id for r in reply.results] == [i.stream_id for i in items]
        for r in reply.results:
            deltas[r.stream_id].append(r.text)
    for s, ids in streams.items():
        assert "".join(deltas[s]) == demo_tokenizer.decode(ids, skip_special_tokens=skip[s])
        assert not any("\ufffd" in t for t in deltas[s])
    assert "<|im_end|>" not in "".join(deltas[0]) and "<|im_end|>" in "".join(deltas[1])
    assert "" in deltas[0]  # 🦜 is two byte-level tokens: the first is held back


def test_final_flushes_and_forgets_the_stream(demo_tokenizer):
    parrot = demo_tokenizer.encode("🦜")
    assert len(parrot) == 2  # a character split across tokens

    messages = [
        [item(7, parrot[:1])],               # held back: incomplete character
        [item(7, [], final=True)],           # flushed as a full decode would
        [item(7, parrot[1:], final=True)],   # a new stream under the freed id: no earlier byte to join
    ]
    replies, code = asyncio.run(with_server(demo_tokenizer, lambda stub: exchange(stub, messages)))
    assert code == grpc.StatusCode.OK
    assert [r.results[0].text for r in replies] == ["", demo_tokenizer.decode(parrot[:1]),
                                                  demo_tokenizer.decode(parrot[1:])]
    assert "\ufffd" in replies[1].results[0].text


def test_close_forgets_without_a_result(demo_tokenizer):
    parrot = demo_tokenizer.encode("🦜")
    messages = [
        [item(1, parrot[:1]), item(2, parrot[:1])],
        [item(1, close=True), item(2, parrot[1:], final=True), item(99, close=True)],  # 99: never opened
        [item(1, parrot[1:], final=True)],
        [item(3, close=True)],
    ]
    replies, code = asyncio.run(with_server(demo_tokenizer, lambda stub: exchange(stub, messages)))
    assert code == grpc.StatusCode.OK
    assert [[(r.stream_id, r.text) for r in reply.results] for reply in replies] == [
        [(1, ""), (2, "")],
        [(2, "🦜")],                                        # stream 2 kept its first byte
        [(1, demo_tokenizer.decode(parrot[1:]))],           # stream 1 did not: the closed state is gone
        [],                                                 # a message of closes still gets its reply
    ]


def test_pieces_per_item(demo_tokenizer):
    id_bytes = {rank: token for token, rank in load_ranks(ranks_path()).items()}  # rank = id in Qwen's vocabulary
    a, b = demo_tokenizer.encode(TEXTS[0]), demo_tokenizer.encode(TEXTS[2])
    messages = [[item(1, a, piece_ids=a, final=True), item(2, b[:2]), item(3, b, piece_ids=b[:1], final=True)]]
    (reply,), _ = asyncio.run(with_server(demo_tokenizer, lambda stub: exchange(stub, messages)))
    one, two, three = reply.results
    assert b"".join(one.pieces) == TEXTS[0].encode()
    assert [p for p, i in zip(one.pieces, a) if i != IM_END] == [id_bytes[i] for i in a if i != IM_END]
    assert list(two.pieces) == [] and list(three.pieces) == [id_bytes[b[0]]]


@pytest.mark.parametrize("bad", [item(5, [10**9]), item(5, [1], piece_ids=[10**9])])
def test_a_bad_item_fails_its_own_stream_only(demo_tokenizer, bad):
    """The call carries every generation's text: an id outside the vocabulary ends that stream, not the call."""
    good = demo_tokenizer.encode(TEXTS[0])
    messages = [[item(4, good[:3]), bad], [item(4, good[3:], final=True), item(5, [1], final=True)]]
    (first, second), code = asyncio.run(with_server(demo_tokenizer, lambda stub: exchange(stub, messages)))
    assert code == grpc.StatusCode.OK
    ok, refused = first.results
    assert ok.error_code == 0 and refused.stream_id == 5 and refused.text == "" and not refused.pieces
    assert refused.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "outside the vocabulary" in refused.error_message
    rest, reopened = second.results
    assert ok.text + rest.text == TEXTS[0]  # the other stream never noticed
    assert reopened.error_code == 0 and reopened.text == demo_tokenizer.decode([1])  # stream 5 was forgotten: fresh


def test_a_close_with_ids_ends_the_call_with_invalid_argument(demo_tokenizer):
    """A close that carries ids is the caller breaking the protocol, not one stream's bad data."""
    async def body(stub):
        return await status_after(stub.DecodeBatches(), tokenizer_pb2.DecodeBatchRequest(
            items=[item(4, [1, 2]), item(5, [1], close=True)]))

    code, details = asyncio.run(with_server(demo_tokenizer, body))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "a close item carries no token_ids" in details


# --- bounds on what a caller that never sends `final` can make the service hold --------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_open_streams_are_bounded_and_only_idle_ones_make_room(demo_tokenizer):
    clock = Clock()
    batch = DecodeBatchState(demo_tokenizer, StreamLimits(max_streams=3, idle_s=10.0), clock)
    for stream_id in range(3):  # opened, never finished
        batch.add(stream_id, [1], final=False, skip_special_tokens=True)
    clock.now = 5.0
    with pytest.raises(ResourceExhausted, match="already holds 3 open streams"):
        batch.add(3, [1], final=False, skip_special_tokens=True)
    assert list(batch.streams) == [0, 1, 2]  # live streams are never dropped for a new one
    clock.now = 8.0
    batch.add(0, [2], final=False, skip_special_tokens=True)  # 0 is in use again: 1 is now the least recent
    clock.now = 12.0
    assert batch.add(3, [1], final=False, skip_special_tokens=True) == demo_tokenizer.decode([1])
    assert list(batch.streams) == [2, 0, 3] and batch.dropped == 1
    # A caller that leaks a stream per request: the table never grows past the bound.
    for stream_id in range(4, 1000):
        clock.now += 11.0
        batch.add(stream_id, [1], final=False, skip_special_tokens=True)
        assert len(batch.streams) <= 3 and batch.last_used.keys() == batch.streams.keys()
    # Ended streams free their place at once, idle or not.
    batch.add(999, [], final=True, skip_special_tokens=True)
    batch.close(998, [], [])
    assert list(batch.streams) == [997]


def test_a_stream_past_the_bound_fails_its_own_item_and_the_call_goes_on(demo_tokenizer):
    parrot = demo_tokenizer.encode("🦜")
    messages = [
        [item(1, parrot[:1]), item(2, parrot[:1]), item(3, [1])],  # 3: a third open stream, one too many
        [item(1, parrot[1:], final=True), item(3, [1], final=True), item(2, parrot[1:], final=True)],
    ]
    (first, second), code = asyncio.run(with_server(
        demo_tokenizer, lambda stub: exchange(stub, messages), stream_limits=StreamLimits(2, 3600.0)))
    assert code == grpc.StatusCode.OK
    assert [(r.stream_id, r.error_code) for r in first.results] == [
        (1, 0), (2, 0), (3, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])]
    assert "--max-decode-streams" in first.results[2].error_message
    # Stream 1's final freed a place for stream 3; stream 2 kept its held byte throughout.
    assert [(r.stream_id, r.error_code, r.text) for r in second.results] == [
        (1, 0, "🦜"), (3, 0, demo_tokenizer.decode([1])), (2, 0, "🦜")]


def test_a_held_back_tail_of_invalid_bytes_is_bounded(demo_tokenizer):
    """A lone UTF-8 lead byte repeated is never a character: it must not pile up in the window."""
    lead = demo_tokenizer.tokenizer.token_to_id("ä")  # the byte-level token of 0xE4, a 3-byte lead
    assert demo_tokenizer.decode([lead]) == "\ufffd"
    state, texts, longest = DecodeStreamState(demo_tokenizer, skip_special_tokens=True), [], 0
    for _ in range(200):
        texts.append(state.add([lead]))
        longest = max(longest, len(state.window))
    texts.append(state.add([], final=True))
    assert longest <= 2 * (MAX_HELD_IDS + 1)
    assert "".join(texts) == demo_tokenizer.decode([lead] * 200)  # still exactly the full decode
    # A character split over tokens is held as before.
    parrot = demo_tokenizer.encode("🦜")
    state = DecodeStreamState(demo_tokenizer, skip_special_tokens=True)
    assert [state.add(parrot[:1]), state.add(parrot[1:])] == ["", "🦜"]
