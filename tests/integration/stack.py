"""Start the three real services as subprocesses, the way the README does, and wait on their health."""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.model_worker.host.cpu_affinity import inherited_by_children
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's range for outgoing connections' local ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A local TCP port nothing listens on, for a server started later.

    Picked below the kernel's ephemeral range and never twice in a process: a port the kernel hands out
    for binding port 0 is one it also gives outgoing connections, so between this call and the server's
    bind a client of another service could take it (a gateway once failed to serve its metrics so:
    "Address already in use")."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(20000, low) if low > 20100 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free local port found")


def wait_serving(address: str, timeout: float = 120.0, credentials: grpc.ChannelCredentials | None = None,
                 want=health_pb2.HealthCheckResponse.SERVING) -> None:
    deadline = time.monotonic() + timeout
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == want:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not reach {health_pb2.HealthCheckResponse.ServingStatus.Name(want)} "
                       f"in {timeout} s")


def gateway_info(gateway: Service) -> dict[str, gateway_pb2.WorkerStatus]:
    """The gateway's own view of its workers (its GetInfo), by address."""
    with grpc.insecure_channel(gateway.address) as channel:
        info = gateway_pb2_grpc.GatewayServiceStub(channel).GetInfo(gateway_pb2.GetInfoRequest(), timeout=5)
    return {w.address: w for w in info.workers}


def wait_workers_serving(gateway: Service, count: int, timeout: float = 60.0) -> None:
    """Until the gateway reports `count` workers serving. It serves once one worker does; a test that spreads
    requests over several, or routes by what each serves, needs it to have heard from all of them."""
    deadline = time.monotonic() + timeout
    while (states := [w.state for w in gateway_info(gateway).values()]) != ["serving"] * count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway's workers are {states} after {timeout} s, not {count} serving")
        time.sleep(0.1)


@dataclass
class Service:
    name: str
    args: list[str]
    port: int
    log_path: str
    process: subprocess.Popen | None = None
    cpus: frozenset[int] | None = None  # the CPUs to start it on (None: this process's own)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")
        with inherited_by_children(self.cpus):
            self.process = subprocess.Popen([sys.executable, "-m", *self.args, "--port", str(self.port)], cwd=ROOT,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _thread_files(pid: int, name: str) -> dict[int, str]:
    """/proc/PID/task/TID/NAME of each of a process's threads, by thread id; none once it has gone.
    A thread that ends while this reads is left out."""
    texts = {}
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                with open(f"/proc/{pid}/task/{task}/{name}") as f:
                    texts[int(task)] = f.read()
    return texts


def child_pids(pid: int) -> list[int]:
    """A process's children (for the worker, its engine core); none once it has gone."""
    return [int(child) for text in _thread_files(pid, "children").values() for child in text.split()]


def thread_nice(pid: int) -> dict[int, int]:
    """Each thread's nice value, by thread id: field 19 of /proc/PID/task/TID/stat (after the command's parentheses)."""
    return {task: int(text.rsplit(")", 1)[1].split()[16]) for task, text in _thread_files(pid, "stat").items()}


def thread_status(pid: int, field: str) -> dict[int, str]:
    """One field of each thread's /proc status (such as Cpus_allowed_list), by thread id."""
    return {task: next(line.split()[1] for line in text.splitlines() if line.startswith(field + ":"))
            for task, text in _thread_files(pid, "status").items()}


@dataclass
class Stack:
    tokenizer: Service
    worker: Service
    gateway: Service
    extra: list[Service] = field(default_factory=list)

    @property
    def services(self) -> list[Service]:
        return [self.tokenizer, self.worker, self.gateway]

    def start(self, timeout: float = 180) -> None:
        """Start every service and wait until each is SERVING; on failure stop them all and show the logs."""
        for service in self.services:
            service.start()
        deadline = time.monotonic() + timeout
        try:
            for service in self.services:
                while True:
                    if service.process.poll() is not None:
                        raise RuntimeError(f"{service.name} exited with {service.process.returncode}:\n"
                                           f"{service.log()[-3000:]}")
                    try:
                        wait_serving(service.address, timeout=2)
                        break
                    except TimeoutError:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{service.name} not serving after {timeout} s:\n"
                                               f"{service.log()[-3000:]}") from None
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()


def make_stack(checkpoint: str, log_dir: str, worker_flags=(), gateway_flags=(), tokenizer_flags=(),
               common_flags=()) -> Stack:
    tok_port, worker_port, gw_port = free_port(), free_port(), free_port()
    tokenizer = Service("tokenizer", ["services.tokenizer", "--model", checkpoint, *common_flags, *tokenizer_flags],
                        tok_port, f"{log_dir}/tokenizer.log")
    worker = Service("worker", ["services.model_worker", "--model", checkpoint, "--dtype", "float32",
                                *common_flags, *worker_flags], worker_port, f"{log_dir}/worker.log")
    gateway = Service("gateway", ["gateway", "--tokenizer-addr", f"127.0.0.1:{tok_port}",
                                  "--worker-addr", f"127.0.0.1:{worker_port}", *common_flags, *gateway_flags],
                      gw_port, f"{log_dir}/gateway.log")
    return Stack(tokenizer, worker, gateway)
