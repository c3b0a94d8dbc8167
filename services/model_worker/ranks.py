"""Tensor-parallel ranks: rank 0 (the engine core) starts the others and hands them each step's inputs.

python -m services.model_worker.ranks is one of ranks 1..N-1: it loads its shard of the model,
sizes its KV cache like rank 0, then runs the forward of every step rank 0 broadcasts until told to
stop. Rank 0 alone schedules and samples. Whoever dies first, nothing hangs: rank 0 exits with
EXIT_RANK_LOST as soon as another rank is gone (the worker then fails its streams and exits), the
other ranks exit when rank 0 is gone, and every collective of a step has a timeout.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.model_worker.parallel import TensorParallel
from services.model_worker.step_inputs import StepInputs

log = logging.getLogger("tensor_parallel")

EXIT_RANK_LOST = 3
# A step's all-reduces and gather: ranks do equal work, so a wait this long means a rank is stuck.
# A rank that died is usually noticed at once anyway (its sockets close) or by the watchdogs below.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# Ranks 1..N-1 wait for the next step as long as the worker is idle; rank 0's death ends the wait
# through the parent watchdog, not this timeout.
IDLE_TIMEOUT = timedelta(days=365)
_WATCH_INTERVAL_S = 0.2
_STEP, _STOP = 1, 2
_HEADER = 8  # kind, tokens, seqs, table width, sampled rows, max query len, max context len, unused


@dataclass
class Rendezvous:
    """How rank 1..N-1 finds rank 0: its rank and rank 0's store port."""

    rank: int
    port: int


class StepChannel:
    """Each step's StepInputs from rank 0 to the others as one broadcast of one int32 buffer.

    The buffer is sized for the largest step the scheduler can make (tokens, sequences, block
    table width), so every step is a single broadcast of a known size.
    """

    def __init__(self, group, max_tokens: int, max_seqs: int, max_table_width: int):
        self.group = group
        capacity = _HEADER + 3 * max_tokens + (max_seqs + 1) + max_seqs + max_seqs * max_table_width + max_seqs
        self.buffer = torch.zeros(capacity, dtype=torch.int32)

    def send(self, host: StepInputs) -> None:
        parts = [host.input_ids, host.positions, host.slot_mapping, host.query_start_loc, host.context_lens,
                 host.block_tables.flatten(), host.sample_rows]
        sizes = [host.input_ids.numel(), host.num_seqs, host.block_tables.shape[1], host.sample_rows.numel(),
                 host.max_query_len, host.max_context_len]
        end = _HEADER + sum(p.numel() for p in parts)
        if end > self.buffer.numel():
            raise ValueError(f"a step of {end} integers exceeds the step buffer of {self.buffer.numel()}")
        self.buffer[:_HEADER] = torch.tensor([_STEP, *sizes, 0], dtype=torch.int32)
        torch.cat([p.to(torch.int32) for p in parts], out=self.buffer[_HEADER:end])
        dist.broadcast(self.buffer, src=0, group=self.group)

    def stop(self) -> None:
        self.buffer[0] = _STOP
        dist.broadcast(self.buffer, src=0, group=self.group)

    def receive(self) -> StepInputs | None:
        """The next step's inputs; None when rank 0 says stop."""
        dist.broadcast(self.buffer, src=0, group=self.group)
        kind, tokens, seqs, width, sampled, max_query_len, max_context_len, _ = self.buffer[:_HEADER].tolist()
        if kind == _STOP:
            return None
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, sampled]
        parts = self.buffer[_HEADER:_HEADER + sum(sizes)].split(sizes)
        return StepInputs(parts[0].long(), parts[1].long(), parts[2].long(), parts[3].clone(), parts[4].clone(),
                          parts[5].reshape(seqs, width).clone(), parts[6].long(), max_query_len, max_context_len)


class RankGroup:
    """This process's membership of the tensor-parallel group; on rank 0 also the other ranks' processes."""

    def __init__(self, tp: TensorParallel, step_group, processes: list[subprocess.Popen] | None = None):
        self.tp = tp
        self.step_group = step_group
        self.processes = processes or []
        self.closing = False
        tp.on_failure = self._collective_failed

    @classmethod
    def launch(cls, checkpoint: str, config, device: torch.device) -> RankGroup:
        """Rank 0: start ranks 1..N-1 and join them; the rendezvous is on a port the OS picks (never fixed)."""
        from services.model_worker import ipc  # ipc imports the engine, which imports this module
        size = config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                               wait_for_workers=False)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        processes = [subprocess.Popen(
            [sys.executable, "-m", "services.model_worker.ranks", "--rank", str(rank), "--size", str(size),
             "--port", str(store.port), "--checkpoint", str(checkpoint),
             "--config", json.dumps(ipc.config_to_dict(config)), "--log-level", level])
            for rank in range(1, size)]
        group = cls(TensorParallel(0, size), None, processes)
        threading.Thread(target=group._watch_ranks, name="rank-watchdog", daemon=True).start()
        log.info("started tensor-parallel ranks 1..%d (pids %s); rendezvous on port %d", size - 1,
                 ", ".join(str(p.pid) for p in processes), store.port)
        group.step_group = _join(store, 0, size, device)
        return group

    @classmethod
    def join(cls, rendezvous: Rendezvous, size: int, device: torch.device) -> RankGroup:
        """Ranks 1..N-1: join rank 0's group."""
        store = dist.TCPStore("127.0.0.1", rendezvous.port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        return cls(TensorParallel(rendezvous.rank, size), _join(store, rendezvous.rank, size, device))

    def close(self, timeout: float = 10.0) -> None:
        """Rank 0: tell the other ranks to stop and wait for them (killing any that do not exit)."""
        if self.closing:
            return
        self.closing = True
        self.stop_steps()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("rank process %d did not stop; killing it", process.pid)
                process.kill()
                process.wait()

    def stop_steps(self) -> None:
        try:
            StepChannel(self.step_group, 0, 0, 0).stop()
        except RuntimeError:
            pass  # a rank is already gone: the wait or the kill in close() ends it

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
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)


def _join(store, rank: int, size: int, device: torch.device):
    """Initialise the default group (NCCL on CUDA, gloo on CPU) and a gloo group for step metadata."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    # Step inputs are built on the host; a separate gloo group lets the idle wait have its own timeout.
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def device_for_rank(device: torch.device, rank: int) -> torch.device:
    """cuda:r for rank r (one device per rank); the CPU for CPU ranks."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _watch_parent() -> None:
    """Exit when rank 0 is gone: an orphaned rank would otherwise wait for steps that never come."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(_WATCH_INTERVAL_S)
    os._exit(EXIT_RANK_LOST)


def serve_steps(engine) -> None:
    """Ranks 1..N-1: run rank 0's steps until it says stop."""
    channel = engine.step_channel
    while (host := channel.receive()) is not None:
        hidden = engine.runner.forward(host)
        if host.sample_rows.numel():
            engine.model.compute_logits(hidden)  # sends this rank's vocab slice to rank 0


def main(argv=None) -> int:
    from rpcserver.server import setup_logging
    from services.model_worker import ipc
    from services.model_worker.engine import LLMEngine

    parser = argparse.ArgumentParser(prog="python -m services.model_worker.ranks",
                                     description="one tensor-parallel rank; the engine core starts it")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="rank 0's rendezvous port")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker owns shutdown; rank 0 says when to stop
    threading.Thread(target=_watch_parent, name="parent-watchdog", daemon=True).start()
    config = ipc.config_from_dict(json.loads(args.config))
    with torch.inference_mode():
        engine = LLMEngine(args.checkpoint, config, rendezvous=Rendezvous(args.rank, args.port))
        serve_steps(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
