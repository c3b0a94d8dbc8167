"""The engine core's periodic log line on load, KV cache and throughput while it is busy."""
from __future__ import annotations

import logging
import time

from services.model_worker.engine.llm_engine import LLMEngine

log = logging.getLogger("engine_core")


class StatsLog:
    """Every interval_s, one line covering the steps since the last line; nothing while idle."""

    def __init__(self, engine: LLMEngine, interval_s: float):
        self.engine = engine
        self.interval_s = interval_s  # <= 0: no lines
        self._open(time.monotonic())

    def _open(self, now: float) -> None:
        self.start = now
        self.steps = 0
        self.generated = 0  # tokens sampled
        self.computed_before = self.engine.scheduler.num_computed_tokens
        self.last_step_end = now

    def step_started(self) -> None:
        if not self.steps:  # throughput counts from the first step, not from idle time before it
            self.start = time.monotonic()

    def step_done(self, num_outputs: int) -> None:
        self.steps += 1
        self.generated += num_outputs
        self.last_step_end = time.monotonic()
        self.maybe_log()

    def seconds_until_due(self) -> float | None:
        """How long an idle loop may sleep before the tail of a busy spell is due; None: nothing to log."""
        if self.interval_s <= 0 or not self.steps:
            return None
        return max(self.start + self.interval_s - time.monotonic(), 0.0)

    def maybe_log(self) -> None:
        now = time.monotonic()
        if self.interval_s <= 0 or now - self.start < self.interval_s:
            return
        if self.steps:
            stats = self.engine.stats()
            elapsed = max(self.last_step_end - self.start, 1e-9)
            computed = self.engine.scheduler.num_computed_tokens - self.computed_before
            log.info("running %d, waiting %d; KV blocks %d used, %d free; prefix cache hit rate %.1f%%; "
                     "%d preemptions; last %.0f s: %.1f tokens/s generated, %.1f tokens/s computed, "
                     "%.1f steps/s", stats["running"], stats["waiting"], stats["kv_blocks_used"],
                     stats["kv_blocks_free"], 100 * stats["prefix_cache_hit_rate"], stats["preemptions"], elapsed,
                     self.generated / elapsed, computed / elapsed, self.steps / elapsed)
        self._open(now)
