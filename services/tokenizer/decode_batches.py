"""Per-call state of DecodeBatches: the open streams of one caller, each a DecodeStreamState, by stream id."""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from rpcserver.errors import InvalidArgument, ResourceExhausted
from services.tokenizer.core import TokenizerCore
from services.tokenizer.decode_stream import DecodeStreamState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamLimits:
    """How many streams one call may hold open, for callers that never send `final` or `close`."""

    max_streams: int = 65536  # a gateway's open generations share one call: room for a large fleet's
    idle_s: float = 300.0     # a stream this long without an item may be dropped to make room

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

    def add(self, stream_id: int, token_ids: list[int], final: bool, skip_special_tokens: bool) -> str:
        """The stream's new text; its first item opens it, with that item's skip_special_tokens."""
        now = self.clock()
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
