"""Per-call state of DecodeBatches: the open streams of one caller, each a DecodeStreamState, by stream id;
and its replies, cut to stay under the message limit."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rpcserver.errors import InvalidArgument, ResourceExhausted
from rpcserver.pieces import GRPC_MESSAGE_BYTES, PIECE_HEADROOM, element_bytes, piece_budget, runs
from services.tokenizer.core import TokenizerCore
from services.tokenizer.decode_stream import DecodeStreamState
from vllm_v0.tokenizer.v1 import tokenizer_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    """How many streams one call may hold open, for callers that never send `final` or `close`,
    and the largest message it may send."""

    max_streams: int = 65536  # a gateway's open generations share one call: room for a large fleet's
    idle_s: float = 300.0     # a stream this long without an item may be dropped to make room
    max_message_bytes: int = GRPC_MESSAGE_BYTES  # the server's send limit: a larger reply would end the call

    def __post_init__(self) -> None:
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.idle_s < 0:
            raise ValueError(f"idle_s must be >= 0, got {self.idle_s}")


class DecodeBatchState:
    """The streams one DecodeBatches call holds open; all of them go with the call.

    At most `limits.max_streams` are open at once. A new stream beyond that takes the place of the
    least recently used one if that one has had no item for `limits.idle_s`; otherwise the new
    stream is refused (RESOURCE_EXHAUSTED for its item) and the open ones are kept. Memory stays
    bounded whatever the caller does, and a live generation is never dropped to make room.
    """

    def __init__(self, core: TokenizerCore, limits: StreamLimits = StreamLimits(),
                 clock: Callable[[], float] = time.monotonic):
        self.core = core
        self.limits = limits
        self.clock = clock
        self.streams: OrderedDict[int, DecodeStreamState] = OrderedDict()  # least recently used first
        self.last_used: dict[int, float] = {}
        self.dropped = 0  # idle streams dropped to make room, over the call's life

    def add(self, stream_id: int, token_ids: list[int], final: bool, skip_special_tokens: bool,
            now: float | None = None) -> str:
        """The stream's new text; its first item opens it, with that item's skip_special_tokens.
        `now`: the clock's time, when the caller read it once for many items."""
        now = self.clock() if now is None else now
        state = self.streams.get(stream_id)
        if state is None:
            self._make_room(stream_id, now)
            state = self.streams[stream_id] = DecodeStreamState(self.core, skip_special_tokens)
        else:
            self.streams.move_to_end(stream_id)
        self.last_used[stream_id] = now
        text = state.add(token_ids, final)
        if final:
            self.forget(stream_id)
        return text

    def forget(self, stream_id: int) -> None:
        """Drop a stream, e.g. one whose item could not be decoded; unknown ids are fine."""
        self.streams.pop(stream_id, None)
        self.last_used.pop(stream_id, None)

    def close(self, stream_id: int, token_ids: list[int], piece_ids: list[int]) -> None:
        """Forget a cancelled stream. Unknown ids are fine: the caller may close a stream that just ended."""
        if token_ids or piece_ids:
            raise InvalidArgument(f"stream {stream_id}: a close item carries no token_ids or piece_ids "
                                  "(send them in an item without close)")
        self.forget(stream_id)

    def _make_room(self, stream_id: int, now: float) -> None:
        if len(self.streams) < self.limits.max_streams:
            return
        oldest = next(iter(self.streams))
        if now - self.last_used[oldest] < self.limits.idle_s:
            raise ResourceExhausted(
                f"stream {stream_id}: this call already holds {len(self.streams)} open streams, the most allowed "
                f"(--max-decode-streams), and none has been idle for {self.limits.idle_s:g} s; end streams with "
                "a final or close item, or open another call")
        if not self.dropped:  # once per call: a caller that leaks streams would otherwise log every request
            log.warning("DecodeBatches: %d streams open; dropping those idle for over %g s to open new ones "
                        "(the caller is not ending its streams with final or close)", len(self.streams),
                        self.limits.idle_s)
        self.dropped += 1
        self.forget(oldest)


def reply_messages(results: list[tokenizer_pb2.DecodeBatchResult],
                   max_message_bytes: int) -> Iterator[tokenizer_pb2.DecodeBatchResponse]:
    """One request's results as replies of at most the piece budget each, a large result cut into parts.

    gRPC ends the whole call, every stream on it, when one message passes the send limit; the
    logprob pieces of a long prompt (about 7 bytes an id, 21 ids a position) pass 4 MiB at some
    30,000 positions. Parts are cut down to one piece or a few characters of text, so every
    message fits whatever the request held.
    """
    budget = piece_budget(max_message_bytes)
    whole = tokenizer_pb2.DecodeBatchResponse(results=results)
    if whole.ByteSize() <= budget:  # the usual reply, a few characters per stream: one size, counted in C
        yield whole
        return
    parts = [part for result in results for part in _cut(result, budget)]
    if not parts:
        yield tokenizer_pb2.DecodeBatchResponse()  # a request of closes alone is still answered
        return
    sizes = [element_bytes(part.ByteSize()) for part in parts]
    for run in runs(sizes, budget):
        yield tokenizer_pb2.DecodeBatchResponse(results=parts[run.start:run.stop])


def _cut(result: tokenizer_pb2.DecodeBatchResult, budget: int) -> list[tokenizer_pb2.DecodeBatchResult]:
    """The result whole if it fits `budget`, else parts of its text, then runs of its pieces, all but the last
    with `more`."""
    if element_bytes(result.ByteSize()) <= budget:
        return [result]
    room = max(4, budget - PIECE_HEADROOM)  # 4: a whole UTF-8 character always fits
    parts = [tokenizer_pb2.DecodeBatchResult(stream_id=result.stream_id, text=chunk)
             for chunk in _text_chunks(result.text, room)]
    pieces = list(result.pieces)
    for run in runs([element_bytes(len(piece)) for piece in pieces], room):
        parts.append(tokenizer_pb2.DecodeBatchResult(stream_id=result.stream_id, pieces=pieces[run.start:run.stop]))
    for part in parts[:-1]:
        part.more = True
    return parts


def _text_chunks(text: str, limit: int) -> Iterator[str]:
    """`text` in chunks of at most `limit` UTF-8 bytes, cut between characters."""
    data = text.encode()
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte: back to the character's start
            end -= 1
        yield data[start:end].decode()
        start = end
