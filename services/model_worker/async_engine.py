"""Runs the engine's step loop on its own thread and streams each request's tokens to asyncio callers."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

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

    def __init__(self, engine: LLMEngine, on_step: Callable[[float, int], None] | None = None):
        self.engine = engine
        self.on_step = on_step  # called on the loop thread with each step's seconds and tokens sampled
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending_adds = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0

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
        limit = self.engine.scheduler.limits.max_waiting
        if len(self.engine.scheduler.waiting) + self._pending_adds >= limit:
            raise ResourceExhausted(f"the worker's queue is full ({limit} requests waiting); retry later")
        if request_id in self._streams:
            raise InvalidArgument(f"request id {request_id!r} is already generating; use a unique id")
        out: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out)
        self._pending_adds += 1
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
        if stream is not None:
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
                self._pending_adds -= 1
                if request_id not in self._streams:
                    continue  # cancelled before it was admitted
                try:
                    self.engine.add_request(request_id, prompt_ids, params)
                except ServiceError as e:
                    self._deliver(request_id, e)
            else:
                self.engine.abort(command[1])

    def _run(self) -> None:
        while not self._stopped:
            self._apply_commands()
            if not self.engine.has_work():
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            try:
                start = time.perf_counter()
                outputs = self.engine.step()
                self.steps += 1
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
