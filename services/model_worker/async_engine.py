"""Runs the engine's step loop on its own thread and streams each request's tokens to asyncio callers."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from rpcserver.errors import InvalidArgument, ResourceExhausted, ServiceError, Unavailable
from services.model_worker.engine import LLMEngine, StepOutput
from services.model_worker.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class AsyncEngine:
    """The only thread that touches the engine is the loop thread.

    Callers post "add" and "abort" commands; the loop applies them between steps, so a
    sequence joins or leaves at any step boundary. Outputs go to per-request asyncio
    queues without ever blocking the loop, so a slow reader cannot delay anyone's step.
    """

    def __init__(self, engine: LLMEngine, on_step: Callable[[float, int], None] | None = None,
                 stats_interval_s: float = 10.0):
        self.engine = engine
        self.on_step = on_step  # called on the loop thread with each step's seconds and tokens sampled
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Adds posted but not yet applied; both threads update it, so under a lock.
        self._pending_adds = 0
        self._pending_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0
        # Tokens computed for requests whose caller had already gone: the price of aborting only
        # at step boundaries, which should stay at a step or two per cancelled stream.
        self.tokens_after_cancel = 0
        self.stats_interval_s = stats_interval_s  # <= 0: no periodic stats line
        self._window = _StatsWindow(time.monotonic())

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[StepOutput]:
        """Yield one StepOutput per step for this request; the last has finish_reason set.

        Leaving the iteration early (the caller cancelled) aborts the sequence.
        """
        if self._stopped:
            raise Unavailable("the worker is shutting down")
        if request_id in self._streams:
            raise InvalidArgument(f"request id {request_id!r} is already generating; use a unique id")
        limit = self.engine.scheduler.limits.max_waiting
        with self._pending_lock:
            # Refuse at once rather than after a trip through the loop: the queue counts adds not yet applied.
            if len(self.engine.scheduler.waiting) + self._pending_adds >= limit:
                raise ResourceExhausted(f"the worker's queue is full ({limit} requests waiting); retry later")
            self._pending_adds += 1
        out: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out)
        self._post(("add", request_id, prompt_ids, params))
        finished = False
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            if isinstance(item, StepOutput):
                self.tokens_after_cancel += 1
            return
        loop, out = stream
        loop.call_soon_threadsafe(out.put_nowait, item)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt_ids, params = command
                # One move under the lock, so generate() never sees the request in neither count.
                with self._pending_lock:
                    self._pending_adds -= 1
                    if request_id not in self._streams:
                        continue  # cancelled before it was admitted
                    try:
                        self.engine.add_request(request_id, prompt_ids, params)
                    except ServiceError as e:
                        self._deliver(request_id, e)
            else:
                self.engine.abort(command[1])

    def _log_stats(self) -> None:
        """Every stats_interval_s, one line on load, cache and throughput since the last line, if anything ran."""
        window, now = self._window, time.monotonic()
        if self.stats_interval_s <= 0 or now - window.start < self.stats_interval_s:
            return
        computed = self.engine.scheduler.num_computed_tokens
        if window.steps:
            stats = self.engine.stats()
            elapsed = max(window.last_step_end - window.start, 1e-9)
            log.info("running %d, waiting %d; KV blocks %d used, %d free; prefix cache hit rate %.1f%%; "
                     "%d preemptions; last %.0f s: %.1f tokens/s generated, %.1f tokens/s computed, "
                     "%.1f steps/s", stats["running"], stats["waiting"], stats["kv_blocks_used"],
                     stats["kv_blocks_free"], 100 * stats["prefix_cache_hit_rate"], stats["preemptions"], elapsed,
                     window.generated / elapsed, (computed - window.computed_before) / elapsed,
                     window.steps / elapsed)
        self._window = _StatsWindow(now, computed_before=computed)

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_work():
                self._log_stats()  # the tail of a busy spell
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                start = time.perf_counter()
                if not self._window.steps:  # throughput counts from the first step, not from idle time
                    self._window.start = time.monotonic()
                outputs = self.engine.step()
                self.steps += 1
                self._window.steps += 1
                self._window.generated += len(outputs)
                self._window.last_step_end = time.monotonic()
                if self.on_step is not None:
                    self.on_step(time.perf_counter() - start, len(outputs))
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("step %d: %d tokens in %.1f ms", self.steps, len(outputs),
                              (time.perf_counter() - start) * 1e3)
            except Exception as e:  # noqa: BLE001 - fail the live requests, keep the worker up
                log.exception("engine step failed; failing the running requests")
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                    self._deliver(request_id, Unavailable(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            for output in outputs:
                self._deliver(output.request_id, output)
            self._log_stats()


@dataclass
class _StatsWindow:
    """Counts since the last periodic stats line."""

    start: float
    steps: int = 0
    generated: int = 0        # tokens sampled
    computed_before: int = 0  # the scheduler's computed-token count when the window opened
    last_step_end: float = 0.0
