"""The group of tensor-parallel ranks: rank 0 (the engine core) starts the others, and all of them join one group.

Ranks 1..N-1 run executor/rank_process.py. Whoever dies first, nothing hangs: rank 0 exits with
EXIT_RANK_LOST as soon as another rank is gone (the worker then fails its streams and exits), the
other ranks exit when rank 0 is gone, and every collective of a step has a timeout.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.model_worker.distributed.parallel import TensorParallel

log = logging.getLogger("tensor_parallel")

EXIT_RANK_LOST = 3
# A step's all-reduces and gather: ranks do equal work, so a wait this long means a rank is stuck.
# A rank that died is usually noticed at once anyway (its sockets close) or by the watchdogs below.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# Ranks 1..N-1 wait for the next step as long as the worker is idle; rank 0's death ends the wait
# through the parent watchdog, not this timeout.
IDLE_TIMEOUT = timedelta(days=365)
_WATCH_INTERVAL_S = 0.2


@dataclass
class Rendezvous:
    """How rank 1..N-1 finds rank 0: its rank and the path of rank 0's store."""

    rank: int
    store: str


def private_store(size: int) -> tuple[dist.FileStore, str]:
    """The ranks' rendezvous: a file store in a new directory only this user can open.

    Not a TCPStore, which listens on every interface for anyone who can reach the port while the
    ranks start. The ranks share a host (one device each), so a file is enough, and the
    directory's mode (0700, from mkdtemp) and random name keep other users out.
    """
    directory = tempfile.mkdtemp(prefix="vllm-v0-ranks-")
    store = dist.FileStore(os.path.join(directory, "store"), size)
    store.set_timeout(COLLECTIVE_TIMEOUT)
    return store, directory


class RankGroup:
    """This process's membership of the tensor-parallel group; on rank 0 also the other ranks' processes."""

    def __init__(self, tp: TensorParallel, step_group, processes: list[subprocess.Popen] | None = None,
                 store_dir: str | None = None):
        self.tp = tp
        self.step_group = step_group
        self.processes = processes or []
        self.store_dir = store_dir  # rank 0: the rendezvous directory, removed at close
        self.closing = False
        tp.on_failure = self._collective_failed

    @classmethod
    def launch(cls, checkpoint: str, config, device: torch.device) -> RankGroup:
        """Rank 0: start ranks 1..N-1 and join them, through a store only this user can reach."""
        size = config.tensor_parallel_size
        store, directory = private_store(size)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        # gloo's own connections between the ranks (theirs inherit it) stay on loopback too, unless the
        # operator says otherwise.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        processes = [subprocess.Popen(
            [sys.executable, "-m", "services.model_worker.executor.rank_process", "--rank", str(rank), "--size",
             str(size), "--store", os.path.join(directory, "store"), "--checkpoint", str(checkpoint),
             "--config", json.dumps(config.to_dict()), "--log-level", level])
            for rank in range(1, size)]
        group = cls(TensorParallel(0, size), None, processes, directory)
        threading.Thread(target=group._watch_ranks, name="rank-watchdog", daemon=True).start()
        log.info("started tensor-parallel ranks 1..%d (pids %s); rendezvous in %s", size - 1,
                 ", ".join(str(p.pid) for p in processes), directory)
        group.step_group = _join(store, group.tp, device)
        return group

    @classmethod
    def join(cls, rendezvous: Rendezvous, size: int, device: torch.device) -> RankGroup:
        """Ranks 1..N-1: join rank 0's group."""
        store = dist.FileStore(rendezvous.store, size)
        store.set_timeout(COLLECTIVE_TIMEOUT)
        tp = TensorParallel(rendezvous.rank, size)
        return cls(tp, _join(store, tp, device))

    def close(self, stop_steps: Callable[[], None] | None = None, timeout: float = 10.0) -> None:
        """Rank 0: tell the other ranks to stop (stop_steps) and wait for them, killing any that do not exit."""
        if self.closing:
            return
        self.closing = True
        if stop_steps is not None:
            try:
                stop_steps()
            except RuntimeError:
                pass  # a rank is already gone: the wait or the kill below ends it
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("rank process %d did not stop; killing it", process.pid)
                process.kill()
                process.wait()
        self._remove_store()

    def _remove_store(self) -> None:
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def _watch_ranks(self) -> None:
        while not self.closing:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None and not self.closing:
                    log.error("tensor-parallel rank %d (pid %d) exited with code %d; the worker cannot serve "
                              "without it", rank, process.pid, process.returncode)
                    self._exit()
            time.sleep(_WATCH_INTERVAL_S)

    def _collective_failed(self, error: Exception) -> None:
        if not self.closing:
            log.error("a tensor-parallel collective failed on rank %d (another rank is gone or stuck): %s",
                      self.tp.rank, error)
            self._exit()

    def _exit(self) -> None:
        """The group is broken for good: end this rank (rank 0 first ends the others, so none lingers)."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        self._remove_store()
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)


def _join(store, tp: TensorParallel, device: torch.device):
    """Join the ranks' groups; returns the gloo group for step inputs.

    The default group is bound to CUDA tensors alone: NCCL on GPUs, and on CPU hosts a gloo binding
    for CUDA that nothing uses. A collective that forgets to name its group then fails on every
    machine, CPU test runs included, rather than only on GPUs, where NCCL cannot take a host tensor.
    The model's collectives go over the device group, host data over gloo groups.
    """
    on_cuda = device.type == "cuda"
    dist.init_process_group("nccl" if on_cuda else "cuda:gloo", store=store, rank=tp.rank, world_size=tp.size,
                            timeout=COLLECTIVE_TIMEOUT)
    tp.device_group = dist.group.WORLD if on_cuda else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    tp.cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    # Step inputs are built on the host; a group of their own lets the idle wait have its own timeout.
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """cuda:r for rank r (one device per rank); the CPU for CPU ranks."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def watch_parent() -> None:
    """Exit when rank 0 is gone: an orphaned rank would otherwise wait for steps that never come."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(_WATCH_INTERVAL_S)
    os._exit(EXIT_RANK_LOST)
