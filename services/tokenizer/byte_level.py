"""A byte-level BPE tokenizer's decode, in Python, for the few ids of a stream's window.

tokenizers' own decode costs a call into Rust (and its thread pool) of some microseconds however
few the ids; a stream's window is a handful of ids each step, for every stream, on the event loop.
This gives the same text: each id's token as the ByteLevel decoder turns it into bytes, special
tokens left out when asked, the bytes decoded as UTF-8 with each invalid sequence replaced by
U+FFFD (Rust's from_utf8_lossy and Python's "replace" both substitute maximal subparts).
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders


def byte_level_table() -> dict[str, int]:
    """Printable character -> byte, the inverse of the byte-level alphabet BPE vocabularies are written in.

    Printable Latin-1 bytes stand for themselves; the 68 others (controls, space, ...) are
    shifted to 256 and up, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


BYTE_LEVEL = byte_level_table()


class ByteLevelText:
    """Text of ids for a tokenizer whose decoder is ByteLevel alone; `of()` returns None for another."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        special = {token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        self.special = frozenset(special)
        self.kept: dict[int, bytes] = {}     # id -> its bytes
        self.skipped: dict[int, bytes] = {}  # the same with special tokens as b""

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ByteLevelText | None:
        return cls(tokenizer) if type(tokenizer.decoder) is decoders.ByteLevel else None

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The text tokenizers' decode gives for `ids` (each already checked to be in range)."""
        table = self.skipped if skip_special_tokens else self.kept
        try:
            data = b"".join([table[i] for i in ids])
        except KeyError:
            for token_id in ids:
                if token_id not in table:
                    self._learn(token_id)
            data = b"".join([table[i] for i in ids])
        return data.decode("utf-8", "replace")

    def _learn(self, token_id: int) -> None:
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            piece = b""  # a padding row of the model's embedding: tokenizers leaves it out
        elif all(char in BYTE_LEVEL for char in token):
            piece = bytes(BYTE_LEVEL[char] for char in token)
        else:
            piece = token.encode("utf-8")  # what the ByteLevel decoder does with a token it cannot map
        self.kept[token_id] = piece
        self.skipped[token_id] = b"" if token_id in self.special else piece
