"""The chaos benchmark's stack: a gateway, two workers and two tokenizers, killed and restarted as a supervisor would.

Each service runs in a session of its own, so it and anything it leaves behind (a worker's engine core)
can be found by process group and swept at the end.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.stack import ROOT, child_pids, free_port

ENGINE_CORE_MODULE = "services.model_worker.core.engine_core"
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class Process:
    """One top-level service on a fixed port; started again on the same port after it is killed."""
    name: str
    role: str  # worker, tokenizer or gateway
    args: list[str]
    port: int
    log_path: str
    popen: subprocess.Popen | None = None
    groups: set[int] = field(default_factory=set)  # every process group it has led

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.alive else None

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", *self.args, "--port", str(self.port)], cwd=ROOT,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.groups.add(self.popen.pid)

    def log_tail(self, chars: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]


async def serving(address: str, timeout: float = 0.5) -> bool:
    """Whether the health service at `address` says SERVING now (a fresh channel: no reconnect back-off)."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == SERVING


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _running_in(pid: int, groups: set[int]) -> bool:
    """A live (not zombie) process of one of `groups`, running this interpreter: one of ours."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[2]) in groups and _cmdline(pid)[:1] == [sys.executable]


class ChaosStack:
    def __init__(self, checkpoint: str, log_dir: str, worker_flags=(), gateway_flags=()):
        def process(name: str, role: str, args: list[str]) -> Process:
            return Process(name, role, args, free_port(), f"{log_dir}/{name}.log")

        self.tokenizers = [process(f"tokenizer-{i}", "tokenizer", ["services.tokenizer", "--model", checkpoint])
                           for i in range(2)]
        self.workers = [process(f"worker-{i}", "worker", ["services.model_worker", "--model", checkpoint,
                                                           "--dtype", "float32", *worker_flags]) for i in range(2)]
        self.gateway = process("gateway", "gateway", [
            "gateway", "--tokenizer-addr", ",".join(t.address for t in self.tokenizers),
            "--worker-addr", ",".join(w.address for w in self.workers), *gateway_flags])

    @property
    def processes(self) -> list[Process]:
        return [*self.tokenizers, *self.workers, self.gateway]

    async def start(self, timeout: float = 300) -> None:
        for p in self.processes:
            p.start()
        deadline = time.monotonic() + timeout
        while not await self.whole():
            dead = next((p for p in self.processes if not p.alive), None)
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with {dead.popen.returncode}:\n{dead.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stack did not serve within {timeout} s; logs in "
                                   f"{os.path.dirname(self.gateway.log_path)}")
            await asyncio.sleep(0.2)

    @staticmethod
    def engine_core(worker: Process) -> int | None:
        """The worker's engine-core process, if it has one now."""
        if worker.pid is None:
            return None
        return next((pid for pid in child_pids(worker.pid) if ENGINE_CORE_MODULE in _cmdline(pid)), None)

    async def up(self, processes: list[Process]) -> bool:
        """Each of `processes` running and serving, each worker among them with its engine core."""
        if not all(p.alive and (p.role != "worker" or self.engine_core(p)) for p in processes):
            return False
        return all(await asyncio.gather(*(serving(p.address) for p in processes)))

    async def whole(self) -> bool:
        return await self.up(self.processes)

    async def wait_up(self, processes: list[Process], deadline: float) -> bool:
        while not await self.up(processes):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def wait_whole(self, deadline: float) -> bool:
        return await self.wait_up(self.processes, deadline)

    async def wait_ready_for(self, kind: str, deadline: float) -> bool:
        """Wait until every process of the role a kill of `kind` hits serves, and the gateway does: one failure
        at a time per role, while other roles may still be restarting."""
        return await self.wait_up([*self.targets(kind), self.gateway], deadline)

    def targets(self, kind: str) -> list[Process]:
        """The processes a kill of `kind` may hit (for an engine core: the worker whose core it is)."""
        return {"engine-core": self.workers, "worker": self.workers, "tokenizer": self.tokenizers,
                "gateway": [self.gateway]}[kind]

    async def others_serving(self, kind: str, target: Process) -> bool:
        """Whether a process other than `target` serves the role a kill of `kind` takes out (a gateway has none)."""
        peers = {"engine-core": self.workers, "worker": self.workers, "tokenizer": self.tokenizers,
                 "gateway": []}[kind]
        return any(await asyncio.gather(*(serving(p.address) for p in peers if p is not target)))

    def kill(self, kind: str, target: Process) -> tuple[int, list[int]]:
        """SIGKILL the engine core of `target` or `target` itself; its pid and the processes it leaves behind."""
        pid = self.engine_core(target) if kind == "engine-core" else target.pid
        if pid is None:
            raise RuntimeError(f"{target.name} has no {kind} process to kill")
        left = descendants(pid)
        os.kill(pid, signal.SIGKILL)
        return pid, left

    async def back(self, kind: str, target: Process, killed: int, deadline: float) -> float | None:
        """When the killed process's successor serves (a core's: its worker serving on a new core); None past `deadline`."""
        while time.monotonic() < deadline:
            if kind == "engine-core":
                core = self.engine_core(target)
                ready = core is not None and core != killed
            else:
                ready = target.alive and target.pid != killed
            if ready and await serving(target.address):
                return time.monotonic()
            await asyncio.sleep(0.05)
        return None

    def sweep(self, pids: list[int]) -> int:
        """SIGKILL whichever of `pids` still run as ours; how many did."""
        groups = {g for p in self.processes for g in p.groups}
        running = [pid for pid in pids if _running_in(pid, groups)]
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(running)

    def members(self) -> list[int]:
        """Every live process in a group one of the services has led."""
        groups = {g for p in self.processes for g in p.groups}
        return [int(e) for e in os.listdir("/proc") if e.isdigit() and _running_in(int(e), groups)]

    def stop(self, grace_s: float = 10.0) -> tuple[int, list[str]]:
        """SIGTERM every service, then SIGKILL whatever of theirs still runs: (how many needed SIGKILL, any left)."""
        for p in self.processes:
            if p.alive:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(max(0.0, deadline - time.monotonic()))
        swept = self.sweep(self.members())
        for p in self.processes:
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(5)
        time.sleep(0.2)  # a killed orphan is reaped by init, not by us
        return swept, [f"{pid} {' '.join(_cmdline(pid))[:120]}" for pid in self.members()]
