"""Per-call state of DecodeBatches: the open streams of one caller, each a DecodeStreamState, by stream id."""
from __future__ import annotations

from rpcserver.errors import InvalidArgument
from services.tokenizer.core import TokenizerCore
from services.tokenizer.decode_stream import DecodeStreamState


class DecodeBatchState:
    """The streams one DecodeBatches call holds open; all of them go with the call."""

    def __init__(self, core: TokenizerCore):
        self.core = core
        self.streams: dict[int, DecodeStreamState] = {}

    def add(self, stream_id: int, token_ids: list[int], final: bool, skip_special_tokens: bool) -> str:
        """The stream's new text; its first item opens it, with that item's skip_special_tokens."""
        state = self.streams.get(stream_id)
        if state is None:
            state = self.streams[stream_id] = DecodeStreamState(self.core, skip_special_tokens)
        text = state.add(token_ids, final)
        if final:
            del self.streams[stream_id]
        return text

    def forget(self, stream_id: int) -> None:
        """Drop a stream, e.g. one whose item could not be decoded; unknown ids are fine."""
        self.streams.pop(stream_id, None)

    def close(self, stream_id: int, token_ids: list[int], piece_ids: list[int]) -> None:
        """Forget a cancelled stream. Unknown ids are fine: the caller may close a stream that just ended."""
        if token_ids or piece_ids:
            raise InvalidArgument(f"stream {stream_id}: a close item carries no token_ids or piece_ids "
                                  "(send them in an item without close)")
        self.forget(stream_id)
