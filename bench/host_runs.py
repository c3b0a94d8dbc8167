"""Our side of bench_host.py: one in-process engine stepped directly, through EngineCore's socket, and by generate()."""
from __future__ import annotations

import gc
import itertools
import pathlib
import socket
import subprocess
import sys
import time
from operator import attrgetter, itemgetter

from rpcserver import collector
from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core import protocol
from services.model_worker.core.engine_core import EngineCore
from services.model_worker.engine.llm_engine import LLMEngine

ROOT = pathlib.Path(__file__).resolve().parent.parent
PHASE_MODEL = "model"  # the one phase of a step that is not host work
KV_CACHE_BYTES = 256 << 20  # ours and vLLM's alike: 256 streams of 144 tokens need a few MiB


def decode_figures(start: float, steps: list, streams: int, expected_tokens: int) -> dict:
    """From each step's (end time, tokens out, streams that got their first token): the decode steps' figures.

    Decode steps are those after the step that gave the last stream its first token; whole_tok_s counts every
    token from `start` (before the first request was added) to the end of the last step.
    """
    started, first_done = 0, None
    for i, (_, _, firsts) in enumerate(steps):
        started += firsts
        if started == streams:
            first_done = i
            break
    total = sum(tokens for _, tokens, _ in steps)
    if first_done is None or total != expected_tokens:
        raise RuntimeError(f"{started} of {streams} streams started and {total} of {expected_tokens} tokens came out")
    decode = steps[first_done + 1:]
    if not decode:
        raise RuntimeError("no decode steps: every stream finished at its first token")
    seconds = steps[-1][0] - steps[first_done][0]
    tokens = sum(tokens for _, tokens, _ in decode)
    return {"tok_s": tokens / seconds, "ms_step": seconds / len(decode) * 1e3, "us_seq": seconds / tokens * 1e6,
            "steps": len(decode), "whole_tok_s": total / (steps[-1][0] - start)}


class StepLog:
    """Each step's (end time, tokens out, first tokens); calls at_decode once every stream has its first token."""

    def __init__(self, streams: int, at_decode):
        self.streams, self.at_decode = streams, at_decode
        self.steps: list[tuple[float, int, int]] = []
        self.seen: set[str] = set()

    def add(self, now: float, outputs: list, request_id) -> None:
        firsts = 0
        if len(self.seen) < self.streams:  # afterwards a step costs the log one append
            before = len(self.seen)
            self.seen.update(map(request_id, outputs))
            firsts = len(self.seen) - before
            if len(self.seen) == self.streams:
                self.at_decode()
        self.steps.append((now, len(outputs), firsts))


def _zero(phases: dict) -> None:
    for name in phases:
        phases[name] = 0.0


# The worker's side of the core's socket, in a process of its own as in production: it decodes every frame.
_READER = """
import socket, sys
from services.model_worker.core import protocol
with socket.socket(fileno=int(sys.argv[1])) as sock, sock.makefile("rb") as stream:
    while protocol.read_blocking(stream) is not None:
        pass
"""


class OursRuns:
    """One LLMEngine in this process; every run checks that each stream got all its tokens."""

    def __init__(self, checkpoint: pathlib.Path, max_num_seqs: int, max_num_batched_tokens: int, max_streams: int):
        limits = SchedulerLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                 max_waiting=max(256, max_streams))
        self.engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", kv_cache_bytes=KV_CACHE_BYTES,
                                                         limits=limits))
        self.eos_ids = self.engine.eos_ids
        self._runs = itertools.count()
        # As the engine core's process does once its model has loaded (engine_core.main); undone in close, so that
        # a peer run in this process after ours collects as it would alone.
        self._threshold = gc.get_threshold()
        collector.settle()
        self.sender, reader = socket.socketpair()
        self.reader = subprocess.Popen([sys.executable, "-c", _READER, str(reader.fileno())], cwd=ROOT,
                                       pass_fds=[reader.fileno()])
        reader.close()

    @property
    def phase_names(self) -> list[str]:
        return list(self.engine.phase_seconds)

    def close(self) -> None:
        self.sender.close()  # the reader's end of file
        if self.reader.wait(60):
            raise RuntimeError(f"the frames' reader failed with exit code {self.reader.returncode}")
        self.engine.close()
        gc.unfreeze()
        gc.set_threshold(*self._threshold)

    @staticmethod
    def _params(max_tokens: int, sampling: dict) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)

    def steps(self, prompts: list[list[int]], max_tokens: int, sampling: dict) -> dict:
        """LLMEngine.step() until done: decode figures, and each phase's ms a decode step."""
        engine, params, tag = self.engine, self._params(max_tokens, sampling), f"steps-{next(self._runs)}"
        phases = engine.phase_seconds
        log = StepLog(len(prompts), lambda: _zero(phases))
        clock, request_id = time.perf_counter, attrgetter("request_id")
        start = clock()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        while engine.has_work():
            outputs = engine.step()
            log.add(clock(), outputs, request_id)
        figures = decode_figures(start, log.steps, len(prompts), len(prompts) * max_tokens)
        per_step = {name: seconds / figures["steps"] * 1e3 for name, seconds in phases.items()}
        figures["phases_ms"] = per_step
        figures["host_ms"] = sum(ms for name, ms in per_step.items() if name != PHASE_MODEL)
        figures["outside_ms"] = figures["ms_step"] - sum(per_step.values())
        return figures

    def core(self, prompts: list[list[int]], max_tokens: int, sampling: dict) -> dict:
        """Through EngineCore: adds applied as commands, each step's update frame encoded and written to the socket."""
        clock, sender = time.perf_counter, self.sender
        sent = {"seconds": 0.0, "bytes": 0, "outputs": []}

        def send(message: dict) -> None:
            start = clock()
            frame = protocol.encode(message)
            sender.sendall(frame)
            sent["seconds"] += clock() - start
            sent["bytes"] += len(frame)
            sent["outputs"] = message["outputs"]

        def at_decode() -> None:
            _zero(phases)
            sent["seconds"], sent["bytes"] = 0.0, 0

        engine, tag = self.engine, f"core-{next(self._runs)}"
        phases = engine.phase_seconds
        core = EngineCore(engine, send, stats_interval_s=0)
        log = StepLog(len(prompts), at_decode)
        params = protocol.params_to_dict(self._params(max_tokens, sampling))
        request_id = itemgetter(0)
        start = clock()
        for i, prompt in enumerate(prompts):
            core._apply({"type": "add", "id": f"{tag}-{i}", "prompt": prompt, "params": params})
        if core.errors:
            raise RuntimeError(f"the core refused requests: {core.errors[:3]}")
        while engine.has_work():
            core._step()
            log.add(clock(), sent["outputs"], request_id)
        figures = decode_figures(start, log.steps, len(prompts), len(prompts) * max_tokens)
        steps = figures["steps"]
        figures["socket_ms"] = sent["seconds"] / steps * 1e3
        figures["frame_kb"] = sent["bytes"] / steps / 1024
        # The core's own work a step besides the engine's phases and the send: stats, outputs to lists, the loop.
        figures["core_other_ms"] = figures["ms_step"] - sum(phases.values()) / steps * 1e3 - figures["socket_ms"]
        return figures

    def generate(self, prompts: list[list[int]], max_tokens: int, sampling: dict) -> dict:
        """One LLMEngine.generate call over every prompt: output tok/s, prefill included."""
        start = time.perf_counter()
        outputs = self.engine.generate(prompts, self._params(max_tokens, sampling))
        seconds = time.perf_counter() - start
        tokens = sum(map(len, outputs))
        if tokens != len(prompts) * max_tokens:
            raise RuntimeError(f"generate gave {tokens} tokens, not {len(prompts) * max_tokens}")
        return {"whole_tok_s": tokens / seconds}
