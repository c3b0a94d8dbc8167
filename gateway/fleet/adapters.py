"""LoRA adapters across the fleet: which the workers serve, and loading or unloading one on every serving worker."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

import grpc

from gateway.fleet.workers import Fleet, Worker
from rpcserver.errors import InvalidArgument, Unavailable
from vllm_v0.worker.v1 import worker_pb2

log = logging.getLogger(__name__)

# How long loading an adapter on a worker that came to serve without it may take (reading the folder).
COMPLETE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WorkerFailure:
    address: str
    code: grpc.StatusCode
    message: str


class AdapterCallFailed(Exception):
    """LoadAdapter or UnloadAdapter failed on some serving workers (`failed`); `done` lists those it succeeded on.
    `code` is the status to answer with: the failures' most common one."""

    def __init__(self, message: str, failed: list[WorkerFailure], done: list[str]):
        super().__init__(message)
        self.failed, self.done = failed, done
        self.code = Counter(f.code for f in failed).most_common(1)[0][0]


class Adapters:
    """The adapters the fleet's workers report (GetInfo's `adapters`, fetched at every health check), and those
    loaded through this gateway, which it loads again on each worker that comes to serve without them."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        # Loaded at runtime through this gateway (name -> path). A worker forgets them when it restarts, and a
        # worker added to the fleet never had them: each is loaded on such a worker once it serves, as --lora-modules
        # adapters are loaded at its start.
        self.loaded: dict[str, str] = {}
        self._completing: dict[str, asyncio.Task] = {}  # by worker address; the loop holds tasks only weakly
        fleet.on_serving.append(self._worker_serving)

    def served(self) -> dict[str, worker_pb2.AdapterInfo]:
        """Those some serving worker has loaded, by name."""
        return self.fleet.adapters()

    def knows(self, adapter: str) -> bool:
        """Whether some worker reported it when last checked, serving now or not."""
        return self.fleet.knows_adapter(adapter)

    def check(self, adapter: str) -> None:
        """Refuses an adapter no worker has reported; one whose workers are all down is left to the routing,
        which answers UNAVAILABLE."""
        if adapter and not self.knows(adapter):
            served = sorted(self.served())
            raise InvalidArgument(f"adapter {adapter!r} is not a LoRA adapter the model workers serve; "
                                  + (f"they serve {', '.join(served)}" if served else "they serve none")
                                  + " (empty: the base model)")

    async def load(self, name: str, path: str, timeout: float | None) -> str:
        """Loads the adapter on every serving worker that lacks it; returns vLLM's words for success.

        A worker that already has `name` from the same `path` is left as it is, so loading again after a
        partial failure (or once new workers serve) completes the fleet.
        """
        workers = await self._serving_facts()
        have = [w for w in workers if any(a.name == name and a.path == path for a in w.info.adapters)]
        if len(have) == len(workers):
            raise InvalidArgument(f"The lora adapter '{name}' has already been loaded.")
        missing = [w for w in workers if w not in have]
        request = worker_pb2.LoadAdapterRequest(name=name, path=path)
        outcomes = await asyncio.gather(*(w.stub.LoadAdapter(request, timeout=timeout) for w in missing),
                                        return_exceptions=True)
        if have or any(not isinstance(o, BaseException) for o in outcomes):
            self.loaded[name] = path  # loaded somewhere: it belongs on every worker
        await _settle(list(zip(missing, outcomes)), f"load {name!r}", have, "loaded")
        log.info("LoRA adapter %r loaded from %s on %s", name, path, ", ".join(w.address for w in missing))
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str, timeout: float | None) -> str:
        """Unloads the adapter from every serving worker; NOT_FOUND when none had it."""
        workers = self._serving()
        self.loaded.pop(name, None)
        request = worker_pb2.UnloadAdapterRequest(name=name)
        outcomes = await asyncio.gather(*(w.stub.UnloadAdapter(request, timeout=timeout) for w in workers),
                                        return_exceptions=True)
        # A worker without it has nothing to unload: its part is done, unless none had it.
        absent = {w.address for w, o in zip(workers, outcomes) if _code(o) == grpc.StatusCode.NOT_FOUND}
        if len(absent) == len(workers):
            raise AdapterCallFailed(f"The lora adapter '{name}' cannot be found.",
                                    [WorkerFailure(w.address, grpc.StatusCode.NOT_FOUND, "") for w in workers], [])
        rest = [(w, o) for w, o in zip(workers, outcomes) if w.address not in absent]
        await _settle(rest, f"unload {name!r}", [], "unloaded")
        log.info("LoRA adapter %r unloaded from %s", name, ", ".join(w.address for w, _ in rest))
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _worker_serving(self, worker: Worker) -> None:
        if self.loaded and worker.address not in self._completing:
            task = asyncio.get_running_loop().create_task(self._complete(worker), name=f"adapters {worker.address}")
            self._completing[worker.address] = task
            task.add_done_callback(lambda _: self._completing.pop(worker.address, None))

    async def _complete(self, worker: Worker) -> None:
        """Loads on `worker` each adapter loaded through this gateway that it lacks; a failure is logged, and the
        worker serves without that adapter (requests naming it go to the workers that have it)."""
        loaded_here = []
        for name, path in list(self.loaded.items()):
            if worker.info is not None and any(a.name == name for a in worker.info.adapters):
                continue
            if self.loaded.get(name) != path:
                continue  # unloaded or replaced meanwhile
            try:
                await worker.stub.LoadAdapter(worker_pb2.LoadAdapterRequest(name=name, path=path),
                                              timeout=COMPLETE_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("LoRA adapter %r: worker %s serves without it; loading it from %s failed: %s %s", name,
                            worker.address, path, e.code().name, _explained(e.code(), e.details() or ""))
                continue
            loaded_here.append(name)
            if self.loaded.get(name) != path:  # unloaded while it loaded here: unload it here too
                try:
                    await worker.stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name=name),
                                                    timeout=COMPLETE_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    pass
                loaded_here.pop()
        if loaded_here:
            log.info("LoRA adapters %s loaded on worker %s, which came to serve without them",
                     ", ".join(repr(n) for n in loaded_here), worker.address)
        try:
            await worker.refresh_info()  # routing sees them now rather than at its next health check
        except grpc.aio.AioRpcError:
            pass

    def _serving(self) -> list[Worker]:
        workers = sorted(self.fleet.serving(), key=lambda w: w.address)
        if not workers:
            raise Unavailable("no model worker is serving; retry shortly")
        return workers

    async def _serving_facts(self) -> list[Worker]:
        """The serving workers with their facts fetched now (another gateway may have changed their adapters);
        one that does not answer keeps its last."""
        workers = self._serving()
        await asyncio.gather(*(w.refresh_info() for w in workers), return_exceptions=True)
        return [w for w in workers if w.info is not None]


async def _settle(outcomes: list[tuple[Worker, object]], action: str, already: list[Worker], done_means: str) -> None:
    """Refetches the facts of the workers the call succeeded on (their adapters changed: routing must see it at
    once) and raises AdapterCallFailed naming each worker it failed on. `already`: workers that needed no call."""
    done = [w for w, o in outcomes if not isinstance(o, BaseException)]
    await asyncio.gather(*(w.refresh_info() for w in done), return_exceptions=True)
    failed = []
    for w, o in outcomes:
        if isinstance(o, grpc.aio.AioRpcError):
            failed.append(WorkerFailure(w.address, o.code(), _explained(o.code(), o.details() or "")))
        elif isinstance(o, BaseException):
            raise o
    if not failed:
        return
    total = len(outcomes) + len(already)
    if len(failed) == total and len({f.message for f in failed}) == 1:
        # Every worker said the same (a missing folder, LoRA off): its words, as a single server says them.
        message = failed[0].message
    else:
        each = "; ".join(f"{f.address}: {f.message}" for f in failed)
        message = f"could not {action} on {len(failed)} of {total} model workers ({each})"
        if done or already:
            message += (f"; it is {done_means} on {', '.join(w.address for w in [*already, *done])}, and requests "
                        "naming it go only to workers that have it. Send the same call again to retry the workers "
                        "that failed")
    log.warning("LoRA adapter: %s", message)
    raise AdapterCallFailed(message, failed, [w.address for w in done])


def _code(outcome: object) -> grpc.StatusCode | None:
    return outcome.code() if isinstance(outcome, grpc.aio.AioRpcError) else None


def _explained(code: grpc.StatusCode, message: str) -> str:
    """A worker's message, with what to do where the status alone says it."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" not in message:
        return f"{message} (LoRA is off on this model worker: start it with --enable-lora)".lstrip()
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return "this model worker cannot serve LoRA adapters (it has no LoadAdapter or UnloadAdapter)"
    return message or code.name
