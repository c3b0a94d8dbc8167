"""How often each stream may send under load: the gateway's messages a second kept under one budget."""
from __future__ import annotations

MIN_INTERVAL_S = 0.002  # below this a stream is not held at all: a light load sends each token as it comes
TICK_S = 0.00025  # the finest grid wake-ups fall on


class MessagePacing:
    """Spreads a budget of `message_rate` messages a second over the open streams.

    Every message costs the gateway (and its client) about the same CPU whatever it carries, so at
    high concurrency a message per token per stream is what one gateway process runs out of first.
    With S streams open, a stream that has just sent waits S / rate seconds before it takes its next
    tokens, and the tokens that came meanwhile go out as one message. Below MIN_INTERVAL_S (a
    handful of streams) nothing waits. A stream's first and last tokens never wait (`StepBuffer`
    wakes on the end). Wake-ups fall on a grid of a quarter of the interval or less, so streams that
    wake together share one call to the tokenizer.
    """

    def __init__(self, message_rate: float):
        self.message_rate = message_rate  # 0: no pacing
        self.open_streams = 0

    def opened(self) -> None:
        self.open_streams += 1

    def closed(self) -> None:
        self.open_streams -= 1

    def next_message_at(self, now: float) -> float | None:
        """When a stream that sent at `now` (loop time) takes its next tokens; None: as soon as they come."""
        if self.message_rate <= 0:
            return None
        interval = self.open_streams / self.message_rate
        if interval < MIN_INTERVAL_S:
            return None
        tick = TICK_S  # a quarter of the interval at most, in powers of two of TICK_S: a grid all streams share
        while tick * 8 <= interval:
            tick *= 2
        return -(-(now + interval) // tick) * tick
