"""The model workers behind the gateway: one channel each, their health, load and cached blocks, and who serves."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from gateway.fleet.block_hash import prompt_block_hashes
from gateway.fleet.members import NOT_SERVING, SERVING, Member, MemberSet
# Imported from here as well: the states a worker is in, and how its targets are read.
from gateway.fleet.members import DNS_PREFIX, UNREACHABLE, parse_targets, resolve, wanted_addresses  # noqa: F401
from gateway.fleet.router import Router, WorkerView
from rpcserver.errors import FailedPrecondition, Unavailable
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# While a stream waits for a worker to serve it again, the workers not serving are checked this often, rather
# than every --health-interval: the wait ends as soon as one is back.
RECHECK_S = 0.2
# A stream on a worker that stopped serving and reports nothing running (its engine core died: it sends nothing
# until its new core is up) is moved once it has had no step for this long, if another worker serves. A draining
# worker, which finishes its streams, reports them running.
STRANDED_S = 0.5


class Worker(Member):
    """One worker: its channel, a health check every interval (or at once when woken), and its load stream."""

    kind = "worker"
    log = log

    def __init__(self, address: str, channel: grpc.aio.Channel, interval: float,
                 on_change: Callable[[], None] = lambda: None):
        super().__init__(address, channel, interval, on_change)
        self.stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        self.info: worker_pb2.GetInfoResponse | None = None
        self.load = worker_pb2.LoadUpdate()  # the latest load the worker reported
        self.blocks: set[bytes] = set()       # block hashes its prefix cache holds, as it reported them
        self.block_size = 0
        self.in_flight = 0  # streams this gateway has open on it
        self.streams: set = set()  # those streams (WorkerStream), so they can be moved when it stops serving
        self.checks = 0  # health checks done: a stream it failed tries it again only after a later one
        self.on_checked: Callable[[], None] = lambda: None
        self._wake = asyncio.Event()
        self._follow: asyncio.Task | None = None
        self._follow_started = -float("inf")  # time.monotonic() of the last load stream's start
        self._follows_load = True  # False once it answered WatchLoad with UNIMPLEMENTED, until it stops serving
        self._status: asyncio.Task | None = None
        self._serving = asyncio.Event()  # set while state is SERVING: the Watch stream is open then

    def start(self) -> None:
        super().start()
        self._status = asyncio.create_task(self._watch_status(), name=f"status {self.address}")

    def wake(self) -> None:
        """Check health now rather than at the next interval (a call to it failed, its load stream ended)."""
        self._wake.set()

    def has_adapter(self, adapter: str) -> bool:
        """Whether it serves `adapter` ("" is the base model, which every worker serves), as it last reported."""
        return not adapter or (self.info is not None and any(a.name == adapter for a in self.info.adapters))

    def serves(self, kind: str) -> bool:
        """Whether it takes requests of `kind` ("generate", "embed" or "score"), as it last reported: its --runner,
        and a checkpoint without lm_head, which embeds only. Unknown until it first answers."""
        info = self.info
        if info is None:
            return True
        if kind == "generate":
            return info.runner != "pooling" and not info.embeddings_only
        return info.runner != "generate" and (kind == "embed" or not info.embeddings_only)

    async def refresh_info(self, timeout: float = 5.0) -> worker_pb2.GetInfoResponse:
        """Its facts now; the adapters it has loaded change while it serves."""
        self.info = await self.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=timeout)
        return self.info

    def view(self) -> WorkerView:
        # The worker's own count is the truth across gateways, but lags a burst this gateway has just sent it.
        return WorkerView(self.address, max(self.load.running + self.load.waiting, self.in_flight), self.blocks)

    def _tasks(self) -> list[asyncio.Task | None]:
        return [self._watch, self._follow, self._status]

    async def _check(self) -> str:
        state = await super()._check()
        if state != SERVING:
            return state
        # Fetched at every check: its loaded adapters change at runtime (through any gateway in front of it).
        try:
            await self.refresh_info()
        except grpc.aio.AioRpcError:
            # First contact or back from a restart: it serves once its facts are known. A serving worker keeps
            # the facts it last gave.
            if self.info is None or self.state != SERVING:
                return NOT_SERVING
        return SERVING

    def _set_state(self, state: str) -> None:
        if state != self.state:
            (self._serving.set if state == SERVING else self._serving.clear)()
            if state != SERVING:
                self._follows_load = True  # it may come back as another build, which streams its load
        super()._set_state(state)

    async def _watch_health(self) -> None:
        while True:
            state = await self._check()
            self.checks += 1
            self._set_state(state)
            self.on_checked()
            if state == SERVING and self._may_follow():
                self._follow_started = time.monotonic()
                self._follow = asyncio.create_task(self._follow_load(), name=f"load {self.address}")
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval)
            except TimeoutError:
                pass
            self._wake.clear()

    async def _watch_status(self) -> None:
        """Health's Watch stream while the worker serves: one whose engine core died says NOT_SERVING at once,
        and its streams can move on within milliseconds rather than at the next check. The stream is closed
        then (a draining worker must not wait for it to stop); coming back is left to the checks, which fetch
        the worker's facts first, and a new stream opens once they see it serve."""
        while True:
            await self._serving.wait()
            call = self._health.Watch(health_pb2.HealthCheckRequest())
            try:
                async for reply in call:
                    if reply.status != health_pb2.HealthCheckResponse.SERVING:
                        self._set_state(NOT_SERVING)
                        self.wake()
                        break
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # a server without Watch: the checks alone it is
                self.wake()
                await asyncio.sleep(self.interval)
            finally:
                call.cancel()

    def _may_follow(self) -> bool:
        """Whether to open a load stream now: none is open, and the last one began an interval ago or more. A
        stream that ends at once (a worker without WatchLoad, or refusing it) would else reopen at every check its
        end wakes: a loop of calls with no pause. A long-lived stream that ends reopens at once."""
        if not self._follows_load or (self._follow is not None and not self._follow.done()):
            return False
        return time.monotonic() - self._follow_started >= self.interval

    async def _follow_load(self) -> None:
        try:
            async for update in self.stub.WatchLoad(worker_pb2.WatchLoadRequest()):
                self.apply(update)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._follows_load = False
                log.info("worker %s streams no load (WatchLoad: UNIMPLEMENTED): it is routed without its cache "
                         "state", self.address)
            else:
                log.debug("worker %s: load stream ended: %s", self.address, e.code().name)
        finally:
            self.blocks = set()  # no longer known; a new stream starts from a snapshot
            self.wake()  # a load stream ends when the worker drains or dies: find out which at once

    def apply(self, update: worker_pb2.LoadUpdate) -> None:
        if update.reset:
            self.blocks = set(update.stored_block_hashes)
        else:
            self.blocks.difference_update(update.evicted_block_hashes)
            self.blocks.update(update.stored_block_hashes)
        self.block_size = update.block_size or self.block_size
        self.load = update


class Fleet(MemberSet[Worker]):
    """Every worker the --worker-addr targets stand for, kept in step with DNS, and the router over them."""

    kind = "worker"
    log = log

    def __init__(self, targets: list[str], open_channel: Callable[[str], grpc.aio.Channel], interval: float,
                 router: Router):
        super().__init__(targets, open_channel, interval)
        self.router = router
        self.workers: dict[str, Worker] = {}
        self._waiters: list[asyncio.Future] = []  # wait_for_change's, woken by any state change or check
        self._mover: asyncio.Task | None = None
        # Called with each worker that comes to serve (it joined, or is back from a restart): Adapters loads the
        # adapters it lacks there.
        self.on_serving: list[Callable[[Worker], None]] = []

    @property
    def members(self) -> dict[str, Worker]:
        return self.workers

    async def start(self) -> None:
        await super().start()
        self._mover = asyncio.create_task(self._move_stranded(), name="move stranded streams")

    async def wait_for_change(self, timeout: float) -> None:
        """Until a worker changes state or completes a health check, at most `timeout` seconds; the workers
        not serving are checked at once, so one that is back is seen now rather than at its next interval."""
        for worker in self.workers.values():
            if not worker.serving:
                worker.wake()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _move_stranded(self) -> None:
        """Move the streams stuck on a worker that stopped serving to the others, while any serves."""
        while True:
            await asyncio.sleep(RECHECK_S)
            # A draining worker still reports the sequences it runs; one whose engine core died reports none.
            stranded = [w for w in self.workers.values()
                        if w.streams and not w.serving and not (w.load.running or w.load.waiting)]
            if not stranded or not self.serving():
                continue
            now = time.monotonic()
            for worker in stranded:
                for stream in list(worker.streams):
                    if now - stream.last_step >= STRANDED_S:
                        stream.move()

    def adapters(self) -> dict[str, worker_pb2.AdapterInfo]:
        """The LoRA adapters the serving workers have loaded, by name (as the first worker to list one has it)."""
        found: dict[str, worker_pb2.AdapterInfo] = {}
        for w in self.serving():
            for adapter in w.info.adapters if w.info is not None else ():
                found.setdefault(adapter.name, adapter)
        return found

    def knows_adapter(self, adapter: str) -> bool:
        """Whether any worker listed `adapter` when it last answered, serving now or not (one restarting)."""
        return any(w.info is not None and w.has_adapter(adapter) for w in self.workers.values())

    def pick(self, prompt_ids: list[int], exclude: tuple[str, ...] = (), adapter: str = "",
             kind: str = "generate") -> Worker | None:
        """The worker for this prompt among those serving requests of `kind` (Worker.serves) that have `adapter`
        ("": the base model), leaving out `exclude` (already tried)."""
        candidates = [w for w in self.serving()
                      if w.address not in exclude and w.has_adapter(adapter) and w.serves(kind)]
        hashes_by_size: dict[int, list[bytes]] = {}
        for w in candidates:
            if w.block_size and w.block_size not in hashes_by_size:
                hashes_by_size[w.block_size] = prompt_block_hashes(prompt_ids, w.block_size, adapter)
        # Workers of different block sizes share no hashes; routing by the first size's is exact for
        # those and sees the others as misses, which then go by load.
        hashes = next(iter(hashes_by_size.values()), [])
        view = self.router.pick([w.view() for w in candidates], hashes)
        return self.workers[view.address] if view is not None else None

    def unserved(self, kind: str) -> str | None:
        """Why no worker can take requests of `kind` where every worker has answered GetInfo and none serves it
        (their --runner, or a checkpoint without lm_head); None where one does, or one has not answered yet: it
        may serve the kind, and refusing for good (FAILED_PRECONDITION) while a worker starts would be wrong."""
        known = [w for w in self.workers.values() if w.info is not None]
        if not known or len(known) < len(self.workers) or any(w.serves(kind) for w in known):
            return None
        what = {"generate": "generation", "embed": "Embed", "score": "Score (reranking)"}[kind]
        return (f"no model worker serves {what}: "
                + ", ".join(f"{w.address} runs --runner {w.info.runner or 'auto'}"
                            + (" on a checkpoint without lm_head" if w.info.embeddings_only else "") for w in known))

    async def close(self) -> None:
        if self._mover is not None:
            self._mover.cancel()
        await super().close()

    def _changed(self) -> None:
        super()._changed()
        self._notify()

    def _worker_changed(self, worker: Worker) -> None:
        self._changed()
        if worker.serving:
            for listener in self.on_serving:
                listener(worker)

    def _join(self, address: str) -> Worker:
        worker = Worker(address, self.open_channel(address), self.interval)
        worker.on_change = functools.partial(self._worker_changed, worker)
        worker.on_checked = self._notify
        return worker

    async def _wait_to_retire(self, worker: Worker) -> None:
        """Until the streams this gateway has on a removed worker are done."""
        while worker.in_flight:
            await asyncio.sleep(self.interval)


async def next_worker(fleet: Fleet, route_ids: list[int], failed: dict[str, int], wait_s: float,
                      deadline: float | None, adapter: str = "", kind: str = "generate") -> Worker:
    """A serving worker for a request of `kind` (Worker.serves) with `adapter`, routed by `route_ids`, leaving out
    those in `failed` (address -> its health checks done when it failed the request) until a check has seen them
    since. With none: FailedPrecondition where no worker serves the kind at all; Unavailable at once before any
    failure, else after waiting for one to serve, at most `wait_s` and never past `deadline` (time.monotonic())."""
    give_up = time.monotonic() + wait_s
    if deadline is not None:
        give_up = min(give_up, deadline)
    while True:
        exclude = tuple(address for address, checks in failed.items()
                        if (w := fleet.workers.get(address)) is None or w.checks <= checks)
        worker = fleet.pick(route_ids, exclude=exclude, adapter=adapter, kind=kind)
        if worker is not None:
            return worker
        if (why := fleet.unserved(kind)) is not None:
            raise FailedPrecondition(why)
        if not failed:
            if adapter and fleet.serving():
                raise Unavailable(f"no serving model worker has the LoRA adapter {adapter!r} loaded now (the "
                                  "ones that had it are not serving); retry shortly")
            raise Unavailable("no model worker is serving; retry shortly")
        left = give_up - time.monotonic()
        if left <= 0:
            raise Unavailable(f"no model worker could go on with the request after its worker failed (waited "
                              f"{wait_s:g} s, within the request's deadline); retry shortly")
        await fleet.wait_for_change(min(left, RECHECK_S))
