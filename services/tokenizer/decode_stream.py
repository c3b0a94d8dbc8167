"""Per-call state of DecodeStream: the window of one generation's ids, and tokens' raw bytes."""
from __future__ import annotations

from services.tokenizer.byte_level import BYTE_LEVEL
from services.tokenizer.core import TokenizerCore

# A UTF-8 character spans at most 4 bytes, hence at most 4 byte tokens (a few more with skipped
# special tokens between them). A tail held back over more ids than this is not a character being
# completed but invalid bytes: it is emitted (as U+FFFD, as `final` would), so the window of a
# stream that never ends stays short and each item's decode cheap.
MAX_HELD_IDS = 16


class TokenPieces:
    """Each id's raw bytes: what a token contributes to the byte stream before UTF-8 decoding."""

    def __init__(self, core: TokenizerCore):
        self.core = core
        self.added = {token_id: content.encode("utf-8") for token_id, content in core.info.special_tokens}
        self.cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        piece = self.cache.get(token_id)
        if piece is None:
            piece = self.cache[token_id] = self._lookup(token_id)
        return piece

    def _lookup(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id]
        token = self.core.tokenizer.id_to_token(token_id)
        if token is None:
            return b""  # a padding row of the model's embedding: decodes to nothing
        if all(char in BYTE_LEVEL for char in token):
            return bytes(BYTE_LEVEL[char] for char in token)
        # Not a byte-level vocabulary: the token's own decode is the best available.
        return self.core.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


class DecodeStreamState:
    """One DecodeStream call: keeps the window decode_incremental needs, so callers send only new ids."""

    def __init__(self, core: TokenizerCore, skip_special_tokens: bool):
        self.core = core
        self.skip_special_tokens = skip_special_tokens
        self.window: list[int] = []
        self.read_offset = 0

    def add(self, token_ids: list[int], final: bool = False) -> str:
        self.window.extend(token_ids)
        flush = final or len(self.window) - self.read_offset > MAX_HELD_IDS
        text, prefix_advance, self.read_offset = self.core.decode_incremental(
            self.window, self.read_offset, self.skip_special_tokens, flush)
        del self.window[:prefix_advance]
        return text
