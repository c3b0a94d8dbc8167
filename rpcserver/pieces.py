"""Large payloads as several stream messages, each under a byte budget that gRPC's message limit leaves room for."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

from google.protobuf.message import Message

# gRPC's default limit on one message: what a peer keeps unless its --max-message-bytes says otherwise.
GRPC_MESSAGE_BYTES = 4 << 20
# The most one split message holds: a quarter of the default limit, so a peer that keeps the default has
# room to spare, and one piece costs milliseconds, not seconds, to build or read on an event loop.
MAX_PIECE_BYTES = 1 << 20
# Room kept in a piece for the fields beside the split one (an offset, a flag, a request id of up to 128
# characters), whose sizes are not known when the runs are cut.
PIECE_HEADROOM = 256

T = TypeVar("T")
M = TypeVar("M", bound=Message)


def piece_budget(max_message_bytes: int) -> int:
    """Bytes a split message may take under a limit of `max_message_bytes`: 1 MiB, or half the limit if smaller.

    Half, because a message is packed up to the budget and may then be joined by one more element.
    """
    return max(1, min(MAX_PIECE_BYTES, max_message_bytes // 2))


def element_bytes(size: int) -> int:
    """What a message of `size` bytes adds as one element of a repeated field numbered under 16:
    a one-byte tag, its length as a varint, itself. Also the size of a message holding only that element."""
    return 1 + varint_bytes(size) + size


def varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def runs(sizes: Sequence[int], budget: int) -> Iterator[range]:
    """Consecutive index ranges of `sizes` whose sum is at most `budget`; an element over it is a range alone."""
    start, used = 0, 0
    for i, size in enumerate(sizes):
        if i > start and used + size > budget:
            yield range(start, i)
            start, used = i, 0
        used += size
    if start < len(sizes):
        yield range(start, len(sizes))


def split_prompt_logprobs(message: M, budget: int, piece: Callable[[], M]) -> list[M]:
    """`message` alone when it fits `budget`; else pieces of its `prompt_logprobs`, then `message` itself.

    The entries are cut by position into runs: each leading run goes in a message that `piece()`
    starts, the last stays in `message`, and each carries `prompt_logprobs_offset`, the prompt
    position of its first entry. Joining the entries of all of them in order gives the original list.
    """
    total = message.ByteSize()
    if total <= budget:
        return [message]
    sizes = [element_bytes(entry.ByteSize()) for entry in message.prompt_logprobs]
    others = total - sum(sizes)  # the message's other fields: the token, its logprobs, ids
    cut = list(runs(sizes, max(1, budget - others - PIECE_HEADROOM)))
    pieces = []
    for positions in cut[:-1]:
        part = piece()
        part.prompt_logprobs.extend(message.prompt_logprobs[positions.start:positions.stop])
        part.prompt_logprobs_offset = positions.start
        pieces.append(part)
    last = cut[-1].start
    del message.prompt_logprobs[:last]
    message.prompt_logprobs_offset = last
    return [*pieces, message]


class PromptLogprobsJoiner:
    """Joins pieces of prompt logprobs (see `split_prompt_logprobs`) back into one list, checking their offsets.

    Pieces are only kept as they come; `complete` copies their entries with protobuf's C code (a whole
    message's MergeFrom: a third of the time of a Python object per entry), once, where the caller chooses:
    40,000 positions of 20 candidates take about 40 ms, too long for an event loop's turn.
    """

    def __init__(self):
        self.pieces: list = []  # the leading pieces, in order
        self.positions = 0  # how many entries they hold

    def add(self, message) -> None:
        """Take a message's entries; ValueError when they do not start where the ones held end."""
        if message.prompt_logprobs_offset != self.positions:
            raise ValueError(f"prompt logprobs from position {message.prompt_logprobs_offset} came after "
                             f"{self.positions} positions: a piece is missing or repeated")
        self.pieces.append(message)
        self.positions += len(message.prompt_logprobs)

    def complete(self, message):
        """`message` (the first token's) with every entry held before its own; ValueError as `add`.

        Without leading pieces that is `message` itself; else a new message, and the pieces are used up.
        """
        if not self.pieces:
            if message.prompt_logprobs_offset:
                self.add(message)  # raises: the leading pieces never came
            return message
        self.add(message)
        pieces, self.pieces, self.positions = self.pieces[:-1], [], 0
        joined = type(message)()
        for piece in pieces:
            for field, _ in piece.ListFields():  # its entries alone: its flag and offset are not the token's
                if field.name != "prompt_logprobs":
                    piece.ClearField(field.name)
            joined.MergeFrom(piece)  # repeated fields append
        joined.MergeFrom(message)
        joined.prompt_logprobs_offset = 0
        return joined
