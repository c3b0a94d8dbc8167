"""Event-loop lag: a task that sleeps a short interval and measures how late it wakes; stalls are logged and exported."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
import traceback

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
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__) + os.sep
STACK_FRAMES = 12  # of a stalled loop thread's stack, innermost, in the stall's log line


class LoopLagMonitor:
    """Sleeps `interval_s` at a time on the running loop; each wake later than asked is a lag, logged past `stall_s`.

    A lag's number says a stall happened, not what held the loop. A thread beside the loop looks at the loop
    thread's stack while a stall lasts, and the stall's log line shows it: the handler or callback that held it,
    or the loop asleep in its selector (the process got no CPU, or another thread held the GIL). Work inside one
    C call holds the GIL, so the look comes once the call lets go: the stack is then the call's caller."""

    def __init__(self, interval_s: float = INTERVAL_S, stall_s: float = STALL_S):
        self.interval_s = interval_s
        self.stall_s = stall_s
        self.wakes = 0  # lags measured so far
        self.max_lag_s = 0.0
        self._task: asyncio.Task | None = None
        self._asked: float | None = None  # when the monitor's current sleep should end (time.monotonic())
        self._seen: tuple[float, str] | None = None  # (that sleep's end, the loop thread's stack during its stall)
        self._done: threading.Event | None = None  # set to end the thread started with the task

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="loop lag monitor")
            self._done = threading.Event()
            threading.Thread(target=self._look, args=(threading.get_ident(), self._done), daemon=True,
                             name="loop lag stacks").start()

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._done.set()
            task.cancel()
            await asyncio.wait([task])  # its end, without taking its cancellation as this caller's

    def observe(self, lag_s: float, held_at: str = "") -> None:
        self.wakes += 1
        LAG_SECONDS.observe(lag_s)
        self.max_lag_s = max(self.max_lag_s, lag_s)
        global _max_lag_s
        if lag_s > _max_lag_s:
            _max_lag_s = lag_s
            MAX_LAG_SECONDS.set(lag_s)
        if lag_s > self.stall_s:
            STALLS.inc()
            log.warning("the event loop stalled for %.0f ms: every call and stream of this server waited that long%s",
                        lag_s * 1000, f"; the loop thread was at:\n{held_at}" if held_at else "")

    async def _watch(self) -> None:
        while True:
            self._asked = asked = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            seen = self._seen
            self.observe(max(0.0, time.monotonic() - asked), seen[1] if seen and seen[0] == asked else "")

    def _look(self, loop_thread: int, done: threading.Event) -> None:
        """The loop thread's stack, once per stall, while it lasts."""
        while not done.wait(self.interval_s):
            asked = self._asked
            if asked is None or time.monotonic() - asked < self.stall_s or (self._seen and self._seen[0] == asked):
                continue
            frame = sys._current_frames().get(loop_thread)
            if frame is not None:
                # asyncio's own frames (run_forever, _run_once, Handle._run) are above every callback alike.
                stack = [f for f in traceback.extract_stack(frame) if not f.filename.startswith(_ASYNCIO_DIR)]
                self._seen = (asked, "".join(traceback.format_list(stack[-STACK_FRAMES:])).rstrip())
