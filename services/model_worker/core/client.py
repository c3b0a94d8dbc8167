"""The worker's side of the engine core: streams each request's tokens to asyncio callers, restarts a dead core
and carries its streams on to the new one."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from rpcserver.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import GenerationDefaults, Qwen3Config
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core import protocol
from services.model_worker.core.kv_events import LoadFeed
from services.model_worker.core.open_streams import OpenStream, OpenStreams, Sink
from services.model_worker.core.pooling_calls import PoolingCall, PoolingCalls
from services.model_worker.core.process import CoreProcess, CoreStartError, describe_exit
from services.model_worker.core.resumes import Resumes
from services.model_worker.distributed.parallel import check_divisible
from services.model_worker.engine.adapters import NOT_ENABLED
from services.model_worker.engine.llm_engine import StepOutput
from services.model_worker.engine.pooling import PoolingOutput, PoolingParams, check_input, check_served
from services.model_worker.executor.random_draws import fresh_seed

log = logging.getLogger(__name__)

# How long a hung core gets to write its threads' stacks before it is killed.
_STACK_DUMP_S = 0.5

# What stats read before any core has reported, and after one died: nothing running, nothing cached.
EMPTY_STATS = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_free": 0, "prefix_cache_hit_rate": 0.0,
               "preemptions": 0, "prefix_queries": 0, "prefix_hits": 0, "adds_applied": 0, "steps": 0}


class EngineClient:
    """Runs the model in an engine-core process and fans its per-step outputs out to per-request sinks.

    Lives on the worker's event loop and never computes: requests go to the core as add and abort
    commands, and each step comes back as one frame. If the core dies, `on_serving(False)` is called and
    a new core is started after a back-off (`on_serving(True)` once it is ready). Its open streams wait
    for that core, at most `resume_wait_s`, and go on there after the token ids they have had, so each
    sink sees one stream, every token once: the new core computes them with the prompt as one prefill
    and draws what the old one would have (greedy, seeded, and unseeded sampled requests alike, whose
    seed the worker chose at submit). A request is carried on at most `max_resumes` times; past that,
    or with 0, or under tensor parallelism (whose ranks are not restarted), its stream fails Unavailable.
    """

    def __init__(self, checkpoint: str | os.PathLike, config: EngineConfig, *, log_level: str = "info",
                 stats_interval_s: float = 10.0, on_serving: Callable[[bool], Awaitable[None]] | None = None,
                 on_step: Callable[[float, int], None] | None = None,
                 restart_delay_s: tuple[float, float] = (1.0, 30.0), engine_cpus: frozenset[int] | None = None,
                 step_timeout_s: float = 120.0, max_resumes: int = 3, resume_wait_s: float = 60.0):
        self.checkpoint = checkpoint
        self.engine_cpus = engine_cpus  # the CPUs every core process runs on; None: the worker's own
        self.config = config
        # Cheap to read here, so requests are validated without a trip to the core.
        self.model_config = Qwen3Config.from_json(checkpoint)
        self.generation = GenerationDefaults.from_dir(checkpoint)
        check_divisible(self.model_config, config.tensor_parallel_size)  # refuse before starting any process
        self.log_level = log_level
        self.stats_interval_s = stats_interval_s
        self.on_serving = on_serving
        self.on_step = on_step  # each step's seconds and tokens sampled, e.g. for metrics
        self.restart_delay_s = restart_delay_s  # first and longest wait before restarting a dead core
        # With requests open, a core that sends no frame for this long is hung and is killed (0: never).
        self.step_timeout_s = step_timeout_s
        self._busy_since = 0.0  # when the open requests went from none to some (time.monotonic)
        self.info: dict | None = None  # the model facts the last ready core reported
        self.stats: dict = dict(EMPTY_STATS)  # the core's latest snapshot, replaced whole on every frame
        self.load_feed = LoadFeed()  # load and cached block hashes, for WatchLoad
        # Tokens computed for requests whose caller had already gone: the price of aborting only
        # at step boundaries, which should stay at a step or two per cancelled stream.
        self.tokens_after_cancel = 0
        # Cores found dead (exited, killed, or hung) and restarted.
        self.restarts = 0
        self.process: CoreProcess | None = None  # the latest core started, ready or not
        self._core: CoreProcess | None = None    # the core serving requests; None while loading or restarting
        self._down_reason = "the model is still loading; retry shortly"
        # Requests cross the socket under ids unique for this client's life, so a late output of a
        # cancelled stream never reaches a new stream that reuses its request id.
        self._ids = itertools.count()
        self._streams = OpenStreams()
        self._pooling = PoolingCalls()
        self.resume = Resumes(self._streams, max_resumes, resume_wait_s)
        self._adds_sent = 0  # to this core; with its adds_applied, the adds still on their way
        self._dead_why: str | None = None  # what the core said in its last frame as it ended after a failed step
        self._supervisor: asyncio.Task | None = None
        # Set when the core is gone for good (tensor parallelism): the worker should exit, non-zero.
        self.failed = asyncio.Event()
        self.failure = ""
        self._closing = False
        self._draining = False
        # LoRA adapters the core serves, by name ({"name", "path", "rank"}), as its last frame said; and the load and
        # unload commands waiting for its reply, by command id.
        self.adapters: dict[str, dict] = {}
        self._adapter_calls: dict[str, asyncio.Future] = {}

    @property
    def serving(self) -> bool:
        return self._core is not None

    async def start(self) -> dict:
        """Start the first core and wait until it is ready; raises CoreStartError if it cannot load the model."""
        core, ready = await self._spawn()
        await self._became_ready(core, ready)
        self._supervisor = asyncio.create_task(self._supervise(core), name="engine-core-supervisor")
        return ready["info"]

    async def close(self, timeout: float = 10.0) -> None:
        """Stop the core (a shutdown command, then a kill after `timeout` seconds); fail what is still open."""
        if self._closing:
            return
        self._closing = True
        self._down_reason = "the worker is shutting down"
        core, self._core = self._core, None
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        process = self.process
        if process is not None and process.popen.poll() is None:
            returncode = await (process.stop(timeout) if process is core else process.kill())
            log.info("engine core (pid %d) %s", process.pid, describe_exit(returncode))
        self.resume.cancel()
        self._streams.fail(self._streams.take_all(), self._down_reason)
        self._pooling.fail_all(self._down_reason)
        self.load_feed.close()

    async def drain(self) -> None:
        """The worker is stopping: refuse new requests (callers retry elsewhere), let open ones finish."""
        self._draining = True
        await self.load_feed.aclose()

    def make_params(self, overrides: dict) -> SamplingParams:
        """Sampling parameters from a request's set fields, defaults from generation_config.json."""
        params = SamplingParams.resolve(overrides, self.generation.sampling)
        params.validate(self.model_config.vocab_size)
        return params

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       output_ids: list[int] = (), adapter: str = "") -> AsyncIterator[StepOutput]:
        """Yield one StepOutput per step for this request; the last has finish_reason set.

        Leaving the iteration early (the caller cancelled) aborts the sequence.
        """
        out: asyncio.Queue = asyncio.Queue()
        core_id = self.submit(request_id, prompt_ids, params, out, output_ids=output_ids, adapter=adapter)
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self.abort(core_id)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink: Sink, *,
               output_ids: list[int] = (), adapter: str = "") -> str:
        """Queue a request on the core; its outputs and its end go to `sink`. Returns the id abort() takes.

        output_ids: the ids a broken stream of this request already generated; it goes on after them.
        adapter: the LoRA adapter to generate with ("": the base model); unknown ones are InvalidArgument.
        Raises Unavailable (no core, or draining), InvalidArgument (a request id already generating)
        or ResourceExhausted (the waiting queue is full) at once, before anything reaches the core.
        """
        core = self._core
        if core is None:
            raise Unavailable(self._down_reason)
        if self._draining:
            raise Unavailable("the worker is shutting down; retry on another worker")
        if self._streams.has_request(request_id):
            raise InvalidArgument(f"request id {request_id!r} is already generating; use a unique id")
        check_served((self.info or {}).get("has_lm_head", True), self.config.runner)
        if adapter:
            self.check_adapter(adapter)
        limit = self.config.limits.max_waiting
        # Refuse at once rather than after a trip through the core: count the adds it has not applied yet.
        if self._queued() >= limit:
            raise ResourceExhausted(f"the worker's queue is full ({limit} requests waiting); retry later")
        # An unseeded sampled request gets its seed here rather than in the core, so that carried on to a new
        # core it draws what it would have.
        seed = fresh_seed() if params.seed is None and not params.is_greedy else None
        stream = OpenStream(str(next(self._ids)), request_id, sink, list(prompt_ids), params, seed, list(output_ids),
                            adapter=adapter)
        self._streams.add(stream)
        self._send_add(core, stream, stream.handle, resume=False)
        return stream.handle

    async def pool(self, request_id: str, prompts: list[list[int]], pooling: PoolingParams,
                   adapter: str = "") -> list[PoolingOutput]:
        """Each prompt's PoolingOutput, in order: all are queued on the core at once, so they share its steps.

        Raises InvalidArgument (a bad input or parameter), ResourceExhausted (the queue is full: the call counts
        as one request, whatever its inputs) or Unavailable (no core, draining, or the core died under them: the
        call is short, so it fails rather than going on on the next core). Cancelling the call drops its inputs
        from the core.
        """
        core = self._core
        if core is None:
            raise Unavailable(self._down_reason)
        if self._draining:
            raise Unavailable("the worker is shutting down; retry on another worker")
        self._check_pooling(prompts, pooling, adapter)
        limit = self.config.limits.max_waiting
        if self._queued() >= limit:
            raise ResourceExhausted(f"the worker's queue is full ({limit} requests waiting); retry later")
        if not self._streams.on_core and not len(self._pooling):
            self._busy_since = time.monotonic()
        call = PoolingCall(len(prompts))
        command = {"type": "pool", "pooling": pooling.to_dict()}
        if adapter:
            command["adapter"] = adapter
        for prompt in prompts:
            core_id = str(next(self._ids))
            self._pooling.place(call, core_id)
            self._adds_sent += 1
            core.send({**command, "id": core_id, "prompt": list(prompt)})
        try:
            return await call.future
        finally:
            running = self._pooling.close(call)
            if running and self._core is core:
                log.debug("pooling call %s ended with %d inputs still running: aborted", request_id, len(running))
                for core_id in running:
                    core.send({"type": "abort", "id": core_id})

    def _queued(self) -> int:
        """Requests waiting on the core or on their way to it, as the queue limit counts them: an open pooling call
        counts as one, however many inputs it has (its inputs are subtracted whether waiting or running, which
        errs on the side of admitting)."""
        queued = self.stats["waiting"] + self._adds_sent - self.stats["adds_applied"]
        return max(queued - len(self._pooling), 0) + self._pooling.num_calls

    def _check_pooling(self, prompts: list[list[int]], pooling: PoolingParams, adapter: str) -> None:
        """InvalidArgument naming the first thing wrong with a pooling call, checked here without a trip to the core."""
        check_served((self.info or {}).get("has_lm_head", True), self.config.runner, pooling)
        if adapter:
            self.check_adapter(adapter)
        if not prompts:
            raise InvalidArgument("inputs is empty: give at least one input")
        vocab = self.model_config.vocab_size
        for i, prompt in enumerate(prompts):
            check_input(prompt, vocab, self.info["max_model_len"], f"inputs[{i}]")
        pooling.validate(vocab, self.model_config.hidden_size)

    def check_adapter(self, name: str) -> None:
        """InvalidArgument unless LoRA is on and an adapter of that name is loaded (the core checks again)."""
        if not self.config.enable_lora:
            raise InvalidArgument(NOT_ENABLED)
        if name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidArgument(f"unknown adapter {name!r} (loaded: {known})")

    async def load_adapter(self, name: str, path: str) -> dict:
        """Load a PEFT folder on the core under `name`; the adapter's {"name", "path", "rank"}."""
        return await self._adapter_call({"type": "load_adapter", "name": name, "path": path})

    async def unload_adapter(self, name: str) -> None:
        """Unload an adapter on the core; its running requests finish first."""
        await self._adapter_call({"type": "unload_adapter", "name": name})

    async def _adapter_call(self, command: dict):
        if not self.config.enable_lora:
            raise FailedPrecondition(NOT_ENABLED)
        core = self._core
        if core is None:
            raise Unavailable(self._down_reason)
        command_id = f"adapter-{next(self._ids)}"
        reply = self._adapter_calls[command_id] = asyncio.get_running_loop().create_future()
        core.send({**command, "id": command_id})
        try:
            return await reply
        finally:
            self._adapter_calls.pop(command_id, None)

    def _adapters_changed(self, adapters: list[dict]) -> None:
        """What the core serves now; a restarted core loads the same (the config it starts with names them)."""
        self.adapters = {a["name"]: a for a in adapters}
        self.config = dataclasses.replace(self.config, lora_modules=tuple((a["name"], a["path"]) for a in adapters))

    def _send_add(self, core: CoreProcess, stream: OpenStream, core_id: str, resume: bool) -> None:
        if not self._streams.on_core and not len(self._pooling):
            self._busy_since = time.monotonic()
        self._streams.place(stream, core_id)
        self._adds_sent += 1
        core.send(stream.add_command(core_id, resume))

    def abort(self, handle: str) -> None:
        """Drop a request that has not ended (a no-op once it has): the core frees it at its next step boundary;
        one waiting for a new core is simply forgotten."""
        stream = self._streams.get(handle)
        if stream is None:
            return
        core_id = stream.core_id
        self._streams.end(stream)
        if core_id is not None and self._core is not None:
            self._core.send({"type": "abort", "id": core_id})

    # -- the core's life -----------------------------------------------------------------------------

    async def _spawn(self) -> tuple[CoreProcess, dict]:
        self.process = core = await CoreProcess.spawn(self.checkpoint, self.config, self.log_level,
                                                      self.stats_interval_s, cpus=self.engine_cpus)
        log.info("engine core started (pid %d); loading the model", core.pid)
        try:
            return core, await core.wait_ready()
        except BaseException:
            if core.popen.poll() is None:  # cancelled while loading: the worker is stopping
                core.popen.kill()
                core.popen.wait()
            raise

    async def _became_ready(self, core: CoreProcess, ready: dict) -> None:
        self.info, self.stats, self._adds_sent = ready["info"], ready["stats"], 0
        self.adapters = {a["name"]: a for a in ready["info"].get("adapters", ())}
        self.load_feed.reset(self.stats)
        self._core = core
        log.info("engine core ready (pid %d)", core.pid)
        # The streams the last core left go on here, under new ids, before any new request.
        self.resume.carry_on(core.pid, lambda stream: self._send_add(core, stream, str(next(self._ids)), resume=True))
        await self._notify(True)

    async def _supervise(self, core: CoreProcess) -> None:
        """Pump the core's frames; when it dies, fail its streams and start another, backing off on failures."""
        first_delay, max_delay = self.restart_delay_s
        try:
            while True:
                hung = await self._pump(core)
                why = await self._went_down(core, hung)
                if self.config.tensor_parallel_size > 1:
                    # A lost rank usually means a lost device, which a restart on the same devices
                    # will not cure: stop, and let whatever runs the worker decide.
                    log.error("%s; a tensor-parallel worker does not restart its ranks: the worker stops", why)
                    self._down_reason = f"{why}; the worker is stopping"
                    self.failure = why
                    self.failed.set()
                    return
                self.restarts += 1
                delay = first_delay
                while True:
                    log.error("%s; restarting it in %.0f s", why, delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, max_delay)
                    try:
                        core, ready = await self._spawn()
                        break
                    except (CoreStartError, OSError) as e:  # OSError: could not even start the process
                        why = f"the engine core failed to start: {e}"
                await self._became_ready(core, ready)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - say so; requests keep getting Unavailable
            log.exception("the engine core supervisor failed; the worker cannot serve until it is restarted")
            self._core = None
            self._down_reason = "the worker's engine core supervisor failed; restart the worker"
            await self._notify(False)

    async def _pump(self, core: CoreProcess) -> str | None:
        """Dispatch the core's frames until its socket closes, it sends one this client cannot read, or it
        hangs; returns why it was killed when it hung.

        Every step ends in a frame, so open requests and no frame for step_timeout_s mean the core is
        stuck (a device that stopped answering, a deadlock): the worker must not wait on it forever.
        """
        read = asyncio.ensure_future(core.read())
        last_frame = time.monotonic()
        try:
            while True:
                await asyncio.wait({read}, timeout=self._watch_interval())
                if not read.done():
                    silent = time.monotonic() - max(last_frame, self._busy_since)
                    busy = self._streams.on_core or len(self._pooling)
                    if busy and self.step_timeout_s and silent >= self.step_timeout_s:
                        return await self._kill_hung(core, silent)
                    continue
                message = read.result()
                if message is None:
                    return None
                last_frame = time.monotonic()
                try:
                    self._dispatch(message)
                except Exception:  # noqa: BLE001 - a core that says nonsense is as good as dead
                    log.exception("unreadable frame from the engine core (pid %d); killing it", core.pid)
                    await core.kill()
                    return None
                read = asyncio.ensure_future(core.read())
        finally:
            read.cancel()

    def _watch_interval(self) -> float:
        return min(1.0, self.step_timeout_s / 4) if self.step_timeout_s else 1.0

    async def _kill_hung(self, core: CoreProcess, silent: float) -> str:
        why = f"made no step for {silent:.0f} s with {len(self._streams.on_core)} requests open (--step-timeout)"
        log.error("the engine core (pid %d) %s; its threads' stacks follow, then it is killed", core.pid, why)
        core.dump_stacks()
        await asyncio.sleep(_STACK_DUMP_S)
        await core.kill()
        return why

    def _dispatch(self, message: dict) -> None:
        if message["type"] != "update":
            raise protocol.ProtocolError(f"unexpected {message['type']!r} frame")
        outputs = [protocol.output_from_list(raw) for raw in message["outputs"]]
        on_core = self._streams.on_core
        for output in outputs:
            stream = on_core.get(output.request_id)
            if stream is None:
                self.tokens_after_cancel += 1
                continue
            stream.output_ids.append(output.token_id)
            stream.delivered += 1
            if output.finish_reason is not None:
                self._streams.end(stream)
            output.request_id = stream.request_id
            stream.sink.put_nowait(output)
        for raw in message.get("pooled", ()):
            if not self._pooling.deliver(protocol.pooled_from_list(raw)):
                log.debug("a pooling output for %s came after its call ended", raw[0])
        if "dead" in message:
            # The core ends after a failed step: its errors are UNAVAILABLE for every open request, which
            # _went_down carries on to the next core, or fails, once the socket closes.
            self._dead_why = message["dead"]
        else:
            for raw in message["errors"]:
                core_id, error = protocol.error_from_list(raw)
                stream = on_core.get(core_id)
                if stream is not None:
                    self._streams.end(stream)
                    stream.sink.put_nowait(error)
                else:
                    self._pooling.fail(core_id, error)
        if "adapters" in message:
            self._adapters_changed(message["adapters"])
        for command_id, kind, text, info in message.get("adapter_replies", ()):
            reply = self._adapter_calls.get(command_id)
            if reply is None or reply.done():
                continue
            if kind:
                reply.set_exception(protocol.error_from_list(["", kind, text])[1])
            else:
                reply.set_result(info)
        self.stats = message["stats"]
        self.load_feed.update(self.stats, [bytes.fromhex(h) for h in message.get("kv_stored", ())],
                              [bytes.fromhex(h) for h in message.get("kv_evicted", ())])
        if message["step_seconds"] is not None and self.on_step is not None:
            self.on_step(message["step_seconds"], len(outputs))

    async def _went_down(self, core: CoreProcess, hung: str | None = None) -> str:
        """Stop serving, park every open stream to wait for the next core (or fail it), and return why
        (hung: why it was killed as hung)."""
        self._core = None
        self._down_reason = "the engine core is down; the worker is restarting it, retry shortly"
        core.close_socket()
        returncode = await core.wait_exit(timeout=5)
        if returncode is None:  # its socket closed but it runs on: it cannot serve, so end it
            returncode = await core.kill()
        why = f"the engine core (pid {core.pid}) {hung or describe_exit(returncode)}"
        if self._dead_why is not None:
            why, self._dead_why = f"{why} ({self._dead_why})", None
        self._down_reason = f"{why}; the worker is restarting it, retry shortly"
        self.stats = dict(EMPTY_STATS)
        self.load_feed.reset(self.stats)
        for reply in self._adapter_calls.values():
            if not reply.done():
                reply.set_exception(Unavailable(f"{why} before the adapter command was applied; retry"))
        self._pooling.fail_all(f"{why}; retry the request")
        streams = self._streams.off_core()
        if not self.resume.max_resumes or self.config.tensor_parallel_size > 1:
            self._streams.fail(streams, f"{why} while generating; retry the request")
            if streams:
                log.error("%s: failed %d open streams", why, len(streams))
        else:
            self.resume.park(streams, core.pid, why)
        await self._notify(False)
        return why

    async def _notify(self, serving: bool) -> None:
        if self.on_serving is not None and not self._closing:
            await self.on_serving(serving)
