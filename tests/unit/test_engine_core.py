"""The engine core's loop: commands in, one update per step out; a failing step ends the core, a bad request does not."""
from __future__ import annotations

import json
import os
import pathlib
import queue
import socket
import subprocess
import sys
import threading
import time

import pytest

from rpcserver.collector import GC_YOUNG_THRESHOLD
from services.model_worker.config.engine import EngineConfig
from services.model_worker.core import protocol as ipc
from services.model_worker.core.engine_core import EngineCore, EngineDeadError
from services.model_worker.core.process import describe_exit
from tests.checkpoints import make_checkpoint
from tests.unit.test_batching import VOCAB, greedy, make_engine

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-engine-core")
    make_checkpoint(path, eos_token_id=())
    return path


def add(request_id: str, prompt: list[int], max_tokens: int) -> dict:
    return {"type": "add", "id": request_id, "prompt": prompt, "params": ipc.params_to_dict(greedy(max_tokens))}


def test_a_failing_step_fails_the_live_requests_and_ends_the_core(checkpoint):
    """A step that raises may have poisoned the device: the open requests hear why, then the core ends.

    A bad request, by contrast (the out-of-vocabulary prompt), fails alone and the core steps on.
    """
    engine = make_engine(checkpoint)
    real_step, steps = engine.step, 0

    def step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise RuntimeError("kernel exploded")
        return real_step()

    engine.step = step
    commands: queue.SimpleQueue = queue.SimpleQueue()
    frames = []
    for command in (add("a", [1, 2, 3], 20), add("b", [7, 8], 20), add("oov", [VOCAB], 2)):
        commands.put(command)
    # On a thread only so that a loop that never ends fails the test instead of hanging it.
    errors = []
    loop = threading.Thread(target=lambda: _run(EngineCore(engine, frames.append, stats_interval_s=0), commands,
                                                errors), daemon=True)
    loop.start()
    loop.join(60)
    assert not loop.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert "RuntimeError: kernel exploded" in str(errors[0])

    assert frames[0]["errors"][0][:2] == ["oov", "invalid_argument"]
    # One frame per step, every sequence in it (in the order admitted: the shorter prompt first).
    assert sorted(out[0] for out in frames[0]["outputs"]) == ["a", "b"]
    assert sorted(out[0] for out in frames[1]["outputs"]) == ["a", "b"]
    failed = frames[-1]
    assert sorted((rid, kind) for rid, kind, _ in failed["errors"]) == [("a", "unavailable"), ("b", "unavailable")]
    assert "RuntimeError: kernel exploded" in failed["errors"][0][2]
    assert len(frames) == 3 and steps == 3


FAILING_CORE = """
import sys
from services.model_worker.core import engine_core
from services.model_worker.engine.llm_engine import LLMEngine

real_step, steps = LLMEngine.step, []

def step(self):
    steps.append(1)
    if len(steps) == 2:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return real_step(self)

LLMEngine.step = step
sys.exit(engine_core.main(sys.argv[1:]))
"""


def test_a_core_process_whose_step_fails_says_why_and_exits_with_its_own_code(checkpoint):
    """The real process: the worker reads UNAVAILABLE for the open request, then end of file and EXIT_ENGINE_DEAD."""
    process, ours = start_core(FAILING_CORE, checkpoint)
    with ours, ours.makefile("rwb") as stream:
        assert ipc.read_blocking(stream)["type"] == "ready"
        stream.write(ipc.encode(add("open", [1, 2, 3], 50)))
        stream.flush()
        frames = []
        while (frame := ipc.read_blocking(stream)) is not None:
            frames.append(frame)
    assert process.wait(60) == ipc.EXIT_ENGINE_DEAD
    assert describe_exit(process.returncode) == "exited with code 4 after a failed step"
    assert [out[0] for out in frames[0]["outputs"]] == ["open"]
    assert [(rid, kind) for rid, kind, _ in frames[-1]["errors"]] == [("open", "unavailable")]
    assert "illegal memory access" in frames[-1]["errors"][0][2]
    assert "engine step failed; the engine core stops" in process.stderr.read()


def start_core(script: str, checkpoint) -> tuple[subprocess.Popen, socket.socket]:
    """An engine-core process running `script` (the real main, with a step patched), and the worker's socket end."""
    ours, theirs = socket.socketpair()
    config = EngineConfig(device="cpu", dtype="float32", num_blocks=64, block_size=4)
    process = subprocess.Popen([sys.executable, "-c", script, "--fd", str(theirs.fileno()), "--checkpoint",
                                str(checkpoint), "--config", json.dumps(config.to_dict()), "--stats-interval", "0"],
                               pass_fds=[theirs.fileno()], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stderr=subprocess.PIPE, text=True)
    theirs.close()
    return process, ours


def _run(core: EngineCore, commands: queue.SimpleQueue, errors: list) -> None:
    try:
        core.run(commands)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


HANGING_CORE = """
import sys, time
from services.model_worker.core import engine_core
from services.model_worker.engine.llm_engine import LLMEngine

def step(self):
    time.sleep(600)  # stuck inside a call, as on a device that stopped answering

LLMEngine.step = step
sys.exit(engine_core.main(sys.argv[1:]))
"""


def test_a_hung_core_writes_where_it_is_stuck_when_asked(checkpoint):
    """The step watchdog's signal: every thread's stack on stderr, the step's frame included."""
    process, ours = start_core(HANGING_CORE, checkpoint)
    try:
        with ours.makefile("rwb") as stream:
            assert ipc.read_blocking(stream)["type"] == "ready"
            stream.write(ipc.encode(add("open", [1, 2, 3], 5)))
            stream.flush()
            time.sleep(1.0)  # inside the step by now
            os.kill(process.pid, ipc.DUMP_STACKS_SIGNAL)
            time.sleep(1.0)
            assert process.poll() is None  # still there: the worker kills it after reading the stacks
    finally:
        process.kill()
        ours.close()
    err = process.stderr.read()
    assert "Thread 0x" in err and 'in step' in err and "in _step" in err, err[-2000:]


COLLECTOR_CORE = """
import gc, sys
from services.model_worker.core import engine_core
from services.model_worker.engine.llm_engine import LLMEngine

real_step, seen = LLMEngine.step, []

def step(self):
    if not seen:
        seen.append(1)
        print("collector", gc.get_threshold()[0], gc.get_freeze_count(), file=sys.stderr, flush=True)
    return real_step(self)

LLMEngine.step = step
sys.exit(engine_core.main(sys.argv[1:]))
"""


def test_a_core_steps_with_its_startup_objects_frozen_and_young_objects_collected_less_often(checkpoint):
    """A 256-sequence step allocates a few objects a sequence: at Python's default threshold the collector ran inside
    steps, and a full collection would walk every module and weight the load left."""
    process, ours = start_core(COLLECTOR_CORE, checkpoint)
    with ours, ours.makefile("rwb") as stream:
        assert ipc.read_blocking(stream)["type"] == "ready"
        stream.write(ipc.encode(add("one", [1, 2, 3], 2)))
        stream.flush()
        while not ipc.read_blocking(stream).get("outputs"):
            pass  # stats and the like: the first step's frame comes once the step has run
    process.kill()
    process.wait(60)
    line = next(line for line in process.stderr.read().splitlines() if line.startswith("collector "))
    threshold, frozen = map(int, line.split()[1:])
    assert threshold == GC_YOUNG_THRESHOLD and frozen > 10_000, line
