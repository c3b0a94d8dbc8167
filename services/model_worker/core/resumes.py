"""A dead engine core's open streams: parked until the next core is ready, then carried on there."""
from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from services.model_worker.core.open_streams import OpenStream, OpenStreams

log = logging.getLogger(__name__)


class Resumes:
    """Parks a dead core's streams and carries them on to the next core, at most max_resumes times each; a
    stream still parked wait_s after the death fails Unavailable, as one past its limit does at once.

    A stream goes on after every token id it has had (output_ids), so its sink sees one stream, each token once.
    """

    def __init__(self, streams: OpenStreams, max_resumes: int, wait_s: float):
        self.streams = streams
        self.max_resumes = max_resumes  # 0: never; a dead core's streams fail
        self.wait_s = wait_s
        # Streams carried on, by cause; and streams that could not be, by why (limit: carried on max_resumes
        # times already; wait: no core was ready within wait_s).
        self.resumed: collections.Counter[str] = collections.Counter()
        self.abandoned: collections.Counter[str] = collections.Counter()
        self._timer: asyncio.TimerHandle | None = None

    def park(self, streams: list[OpenStream], pid: int, why: str) -> None:
        """The dead core's streams (off it already) wait for the next one, but those carried on max_resumes
        times already fail."""
        spent = [s for s in streams if s.resumes >= self.max_resumes]
        for stream in spent:
            log.error("request %s: the engine core (pid %d) died under it after %d tokens; it was carried on %d "
                      "times already (--max-resumes): it fails", stream.request_id, pid, len(stream.output_ids),
                      stream.resumes)
        self.abandoned["limit"] += len(spent)
        self.streams.fail(spent, f"{why} while generating; the request had been carried on to a new engine core "
                          f"{self.max_resumes} times, the most --max-resumes allows; retry the request")
        parked = len(streams) - len(spent)
        if parked:
            log.warning("%s: %d open streams wait for the next engine core (at most %g s, --resume-wait)", why,
                        parked, self.wait_s)
            if self._timer is None:  # a core that died before it served: the wait runs from the first death
                self._timer = asyncio.get_running_loop().call_later(self.wait_s, self._give_up, pid, why)

    def carry_on(self, pid: int, send: Callable[[OpenStream], None]) -> None:
        """A new core (pid) is ready: each parked stream goes on there (`send` adds it to the core)."""
        self.cancel()
        for stream in self.streams.waiting():
            stream.resumes += 1
            send(stream)
            self.resumed["engine_core"] += 1
            log.info("request %s: carried on by the engine core (pid %d) after %d tokens (resume %d of at most %d)",
                     stream.request_id, pid, len(stream.output_ids), stream.resumes, self.max_resumes)

    def cancel(self) -> None:
        """Stop the wait's clock (a core is ready, or the worker is closing)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _give_up(self, pid: int, why: str) -> None:
        self._timer = None
        waiting = self.streams.waiting()
        for stream in waiting:
            log.error("request %s: no engine core was ready within %g s of the death of pid %d (--resume-wait): it "
                      "fails", stream.request_id, self.wait_s, pid)
        self.abandoned["wait"] += len(waiting)
        self.streams.fail(waiting, f"{why} while generating, and no new engine core was ready within {self.wait_s:g} s "
                          "(--resume-wait); retry the request")
