"""The worker's handle on one engine-core process: start it, talk to it, stop or kill it."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys

from services.model_worker.config.engine import EngineConfig
from services.model_worker.core import protocol
from services.model_worker.host import cpu_affinity

log = logging.getLogger(__name__)

# The child runs this package with -m, so it needs the project root on its path wherever the worker was started.
_PROJECT_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
# How long torch's OpenMP threads spin before sleeping between parallel regions, unless the operator
# sets OMP_WAIT_POLICY or GOMP_SPINCOUNT. libgomp's default for one team per CPU spins so long that
# when another process takes a core (the worker's own front, the gateway, the tokenizer), the core's
# steps ran 10x slower here; 1000 spins kept its speed under load, as passive waiting did.
_DEFAULT_SPIN_COUNT = "1000"


class CoreStartError(Exception):
    """The engine core exited, or said it cannot load the model, before it was ready."""


class CoreProcess:
    """One engine-core child process and the worker's end of its socket."""

    def __init__(self, popen: subprocess.Popen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.popen = popen
        self.reader = reader
        self.writer = writer

    @classmethod
    async def spawn(cls, checkpoint: str | os.PathLike, config: EngineConfig, log_level: str,
                    stats_interval_s: float, cpus: frozenset[int] | None = None) -> CoreProcess:
        """Start the process; it inherits stdout and stderr, so its log lines land in the worker's log.

        `cpus`: the only CPUs it may run on (None: the worker's); its thread pools are sized to them.
        """
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH")) if p)
        if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
            env["GOMP_SPINCOUNT"] = _DEFAULT_SPIN_COUNT
        try:
            with cpu_affinity.inherited_by_children(cpus):
                popen = subprocess.Popen(
                    [sys.executable, "-m", "services.model_worker.core.engine_core", "--fd", str(theirs.fileno()),
                     "--checkpoint", str(checkpoint), "--config", json.dumps(config.to_dict()),
                     "--log-level", log_level, "--stats-interval", str(stats_interval_s)],
                    pass_fds=[theirs.fileno()], env=env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child's copy alone keeps its end open: its death is our end of file
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
        except BaseException:
            popen.kill()
            popen.wait()
            ours.close()
            raise
        return cls(popen, reader, writer)

    @property
    def pid(self) -> int:
        return self.popen.pid

    async def wait_ready(self) -> dict:
        """The ready frame; raises CoreStartError if the process fails to load the model or exits first."""
        message = await protocol.read_async(self.reader)
        if message is not None and message["type"] == "ready":
            return message
        self.close_socket()
        returncode = await self.wait_exit(timeout=10)
        if returncode is None:
            returncode = await self.kill()
        if message is not None and message["type"] == "failed":
            raise CoreStartError(message["message"])
        if message is not None:
            raise CoreStartError(f"the engine core sent {message['type']!r} before it was ready")
        raise CoreStartError(f"the engine core {describe_exit(returncode)} before it was ready")

    async def read(self) -> dict | None:
        """The next frame; None once the process has gone."""
        return await protocol.read_async(self.reader)

    def send(self, message: dict) -> bool:
        """Queue a frame without waiting; False if the socket is already closed."""
        if self.writer.is_closing():
            return False
        self.writer.write(protocol.encode(message))
        return True

    def close_socket(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()

    async def wait_exit(self, timeout: float) -> int | None:
        """The exit code (negative: the signal that ended it), or None if it still runs after `timeout`."""
        try:
            return await asyncio.to_thread(self.popen.wait, timeout)
        except subprocess.TimeoutExpired:
            return None

    async def stop(self, timeout: float = 10.0) -> int:
        """Ask it to exit, then kill it if it has not after `timeout` seconds; returns its exit code."""
        self.send({"type": "shutdown"})
        returncode = await self.wait_exit(timeout)
        if returncode is None:
            log.warning("the engine core (pid %d) did not exit within %.0f s of shutdown; killing it", self.pid,
                        timeout)
            returncode = await self.kill()
        self.close_socket()
        return returncode

    def dump_stacks(self) -> None:
        """Ask the core to write every thread's stack to its stderr (the worker's log): where it hung."""
        try:
            os.kill(self.popen.pid, protocol.DUMP_STACKS_SIGNAL)
        except ProcessLookupError:
            pass

    async def kill(self) -> int:
        self.popen.kill()
        self.close_socket()
        return await asyncio.to_thread(self.popen.wait)


def describe_exit(returncode: int) -> str:
    if returncode == protocol.EXIT_ENGINE_DEAD:
        return f"exited with code {returncode} after a failed step"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
