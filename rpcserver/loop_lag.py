"""Event-loop lag: a task that sleeps a short interval and measures how late it wakes; stalls are logged and exported."""
from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

# One asyncio loop serves every client of a process: any lag here is a lag of every call and stream.
LAG_SECONDS = Histogram("vllm_v0_event_loop_lag_seconds", "how much later than asked the event loop woke a short "
                        "sleep: the time something held the loop", buckets=(
                            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
STALLS = Counter("vllm_v0_event_loop_stalls", "event-loop lags over the stall threshold (100 ms)")
MAX_LAG_SECONDS = Gauge("vllm_v0_event_loop_max_lag_seconds", "the largest event-loop lag seen since start")

_max_lag_s = 0.0  # the process's, across monitors, as the gauge reports it

INTERVAL_S = 0.025  # short enough to see a stall of 100 ms, long enough to cost nothing
STALL_S = 0.1


class LoopLagMonitor:
    """Sleeps `interval_s` at a time on the running loop; each wake later than asked is a lag, logged past `stall_s`."""

    def __init__(self, interval_s: float = INTERVAL_S, stall_s: float = STALL_S):
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.wakes = 0  # lags measured so far
        self.max_lag_s = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="loop lag monitor")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # its end, without taking its cancellation as this caller's

    def observe(self, lag_s: float) -> None:
        self.wakes += 1
        LAG_SECONDS.observe(lag_s)
        self.max_lag_s = max(self.max_lag_s, lag_s)
        global _max_lag_s
        if lag_s > _max_lag_s:
            _max_lag_s = lag_s
            MAX_LAG_SECONDS.set(lag_s)
        if lag_s > self.stall_s:
            STALLS.inc()
            log.warning("the event loop stalled for %.0f ms: every call and stream of this server waited that long",
                        lag_s * 1000)

    async def _watch(self) -> None:
        while True:
            asked = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.observe(max(0.0, time.monotonic() - asked))
