"""The model workers behind the gateway: one channel each, their health, load and cached blocks, and who serves."""
from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.fleet.block_hash import prompt_block_hashes
from gateway.fleet.router import Router, WorkerView
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

SERVING, NOT_SERVING, UNREACHABLE = "serving", "not_serving", "unreachable"
DNS_PREFIX = "dns:///"
# While a stream waits for a worker to serve it again, the workers not serving are checked this often, rather
# than every --health-interval: the wait ends as soon as one is back.
RECHECK_S = 0.2
# A stream on a worker that stopped serving and reports nothing running (its engine core died: it sends nothing
# until its new core is up) is moved once it has had no step for this long, if another worker serves. A draining
# worker, which finishes its streams, reports them running.
STRANDED_S = 0.5


def parse_targets(values: list[str] | str) -> list[str]:
    """--worker-addr values (repeatable, each comma-separated) as one list without repeats."""
    values = [values] if isinstance(values, str) else values
    targets: list[str] = []
    for value in values:
        for target in value.split(","):
            if (target := target.strip()) and target not in targets:
                targets.append(target)
    return targets


async def resolve(target: str) -> list[str]:
    """The addresses a target stands for: a dns:/// entry every address its name has now, else itself."""
    if not target.startswith(DNS_PREFIX):
        return [target]
    host, _, port = target[len(DNS_PREFIX):].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a dns:/// worker address needs host:port, got {target!r}")
    infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    addresses = {(f"[{ip}]" if family == socket.AF_INET6 else ip) + f":{port}"
                 for family, _, _, _, (ip, *_) in infos}
    return sorted(addresses)


async def wanted_addresses(targets: list[str], known, unresolved: set[str]) -> list[str]:
    """Every address the targets stand for now, without repeats. A dns:/// target whose lookup fails keeps
    the `known` addresses until it resolves again; `unresolved` holds such targets, so each failure and
    each recovery is logged once."""
    wanted: list[str] = []
    for target in targets:
        try:
            wanted.extend(a for a in await resolve(target) if a not in wanted)
        except OSError as e:  # keep what it stood for until the name resolves again
            if target not in unresolved:
                log.warning("cannot resolve %s (%s); keeping its last addresses until it resolves", target, e)
                unresolved.add(target)
            wanted.extend(a for a in known if a not in wanted and target.startswith(DNS_PREFIX))
            continue
        if target in unresolved:
            log.info("%s resolves again", target)
            unresolved.discard(target)
    return wanted


class Worker:
    """One worker: its channel, a health check every interval (or at once when woken), and its load stream."""

    def __init__(self, address: str, channel: grpc.aio.Channel, interval: float,
                 on_change: Callable[[], None] = lambda: None):
        self.address = address
        self.channel = channel
        self.stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self.interval = interval
        self.on_change = on_change
        self.state = UNREACHABLE
        self.info: worker_pb2.GetInfoResponse | None = None
        self.load = worker_pb2.LoadUpdate()  # the latest load the worker reported
        self.blocks: set[bytes] = set()       # block hashes its prefix cache holds, as it reported them
        self.block_size = 0
        self.in_flight = 0  # streams this gateway has open on it
        self.streams: set = set()  # those streams (WorkerStream), so they can be moved when it stops serving
        self.checks = 0  # health checks done: a stream it failed tries it again only after a later one
        self.on_checked: Callable[[], None] = lambda: None
        self._wake = asyncio.Event()
        self._watch: asyncio.Task | None = None
        self._follow: asyncio.Task | None = None
        self._status: asyncio.Task | None = None
        self._serving = asyncio.Event()  # set while state is SERVING: the Watch stream is open then

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    def start(self) -> None:
        self._watch = asyncio.create_task(self._watch_health(), name=f"watch {self.address}")
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

    async def close(self) -> None:
        tasks = [t for t in (self._watch, self._follow, self._status) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.channel.close()

    async def _check(self) -> str:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return UNREACHABLE
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return NOT_SERVING
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
            (log.info if state == SERVING else log.warning)("worker %s: %s -> %s", self.address, self.state, state)
            self.state = state
            (self._serving.set if state == SERVING else self._serving.clear)()
            self.on_change()

    async def _watch_health(self) -> None:
        while True:
            state = await self._check()
            self.checks += 1
            self._set_state(state)
            self.on_checked()
            if state == SERVING and (self._follow is None or self._follow.done()):
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

    async def _follow_load(self) -> None:
        try:
            async for update in self.stub.WatchLoad(worker_pb2.WatchLoadRequest()):
                self.apply(update)
        except grpc.aio.AioRpcError as e:
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


class Fleet:
    """Every worker the --worker-addr targets stand for, kept in step with DNS, and the router over them."""

    def __init__(self, targets: list[str], open_channel: Callable[[str], grpc.aio.Channel], interval: float,
                 router: Router):
        self.targets = targets
        self.open_channel = open_channel
        self.interval = interval
        self.router = router
        self.workers: dict[str, Worker] = {}
        self._resolver: asyncio.Task | None = None
        # The event loop holds tasks only weakly: without this set a retiring worker's task could be
        # collected mid-wait, leaving its channel open for good.
        self._retiring: set[asyncio.Task] = set()
        self.changed = asyncio.Event()  # set whenever a worker joins, leaves or changes state
        # Targets whose last lookup failed: said once, not every interval (a Kubernetes headless Service
        # has no address at all until its first worker is ready, which can take many minutes).
        self._unresolved: set[str] = set()
        self._waiters: list[asyncio.Future] = []  # wait_for_change's, woken by any state change or check
        self._mover: asyncio.Task | None = None
        # Called with each worker that comes to serve (it joined, or is back from a restart): Adapters loads the
        # adapters it lacks there.
        self.on_serving: list[Callable[[Worker], None]] = []

    async def start(self) -> None:
        await self._resolve()
        if any(t.startswith(DNS_PREFIX) for t in self.targets):
            self._resolver = asyncio.create_task(self._resolve_every_interval(), name="resolve workers")
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

    def serving(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.serving]

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
        """Why no worker can take requests of `kind` where none that has answered serves it (their --runner, or
        a checkpoint without lm_head); None where one does, or none has answered yet."""
        known = [w for w in self.workers.values() if w.info is not None]
        if not known or any(w.serves(kind) for w in known):
            return None
        what = {"generate": "generation", "embed": "Embed", "score": "Score (reranking)"}[kind]
        return (f"no model worker serves {what}: "
                + ", ".join(f"{w.address} runs --runner {w.info.runner or 'auto'}"
                            + (" on a checkpoint without lm_head" if w.info.embeddings_only else "") for w in known))

    async def close(self) -> None:
        for task in (self._resolver, self._mover):
            if task is not None:
                task.cancel()
        for task in self._retiring:
            task.cancel()  # closes the worker at once rather than after its streams
        await asyncio.gather(*(w.close() for w in self.workers.values()))
        await asyncio.gather(*self._retiring, return_exceptions=True)
        self.workers.clear()

    def _changed(self) -> None:
        self.changed.set()
        self._notify()

    def _worker_changed(self, worker: Worker) -> None:
        self._changed()
        if worker.serving:
            for listener in self.on_serving:
                listener(worker)

    async def _resolve(self) -> None:
        wanted = await wanted_addresses(self.targets, self.workers, self._unresolved)
        for address in [a for a in self.workers if a not in wanted]:
            log.info("worker %s: no longer in %s; removing it", address, ", ".join(self.targets))
            worker = self.workers.pop(address)
            task = asyncio.create_task(self._retire(worker), name=f"retire {address}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            self._changed()
        for address in wanted:
            if address not in self.workers:
                worker = Worker(address, self.open_channel(address), self.interval)
                worker.on_change = functools.partial(self._worker_changed, worker)
                worker.on_checked = self._notify
                self.workers[address] = worker
                worker.start()
                self._changed()

    async def _retire(self, worker: Worker) -> None:
        """Close a removed worker's channel once the streams this gateway has on it are done (or the fleet closes)."""
        try:
            while worker.in_flight:
                await asyncio.sleep(self.interval)
        finally:
            await worker.close()

    async def _resolve_every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self._resolve()
