"""Finds stop strings in streamed text, holding back only what could still start one."""


class StopStringMatcher:
    """Streams text through, cutting it before the first stop string.

    The match chosen is the one that completes first as text arrives: the earliest end
    position in the whole text; when several stops end there, the longest (so the cut is
    earliest). Text is held back only while it could be the start of a stop string, so
    at most max(len(stop)) - 1 characters wait at any time, and each feed searches just
    that tail plus the new delta.
    """

    def __init__(self, stops: list[str]) -> None:
        if any(not stop for stop in stops):
            # An empty stop would match before any text; validation rejects it earlier.
            raise ValueError("stop strings must be non-empty")
        self._stops = list(dict.fromkeys(stops))
        self._max_len = max((len(stop) for stop in self._stops), default=0)
        # Every proper prefix of every stop: a tail of the text equal to one of these
        # may still grow into a match, so it must be held back.
        self._prefixes = {stop[:i] for stop in self._stops for i in range(1, len(stop))}
        self._held = ""
        self.stop: str | None = None

    @property
    def has_stops(self) -> bool:
        return bool(self._stops)

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Takes new text; returns (text safe to emit now, the stop matched or None)."""
        if self.stop is not None:
            return "", self.stop
        if not self._stops:
            return delta, None
        text = self._held + delta
        # The held tail contains no whole stop (that would have ended the stream), so any
        # match found here ends inside the new delta.
        match = self._earliest_match(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self.stop = stop
            return text[:start], stop
        cut = self._hold_from(text)
        self._held = text[cut:]
        return text[:cut], None

    def flush(self) -> str:
        """Returns the held-back text at the end of generation, when no stop matched."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # A stop's first occurrence is also its earliest-ending one.
            start = text.find(stop)
            if start < 0:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best[0], best[1]):
                best = (end, start, stop)
        return None if best is None else (best[1], best[2])

    def _hold_from(self, text: str) -> int:
        """Index of the earliest tail of `text` that is a proper prefix of some stop."""
        for cut in range(max(0, len(text) - self._max_len + 1), len(text)):
            if text[cut:] in self._prefixes:
                return cut
        return len(text)
