"""The engine core's loop in-process: commands in, one update per step out, a failing step contained."""
from __future__ import annotations

import queue
import threading

import pytest

from services.model_worker.core import protocol as ipc
from services.model_worker.core.engine_core import EngineCore
from tests.checkpoints import make_checkpoint
from tests.unit.test_batching import VOCAB, greedy, make_engine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-engine-core")
    make_checkpoint(path, eos_token_id=())
    return path


def add(request_id: str, prompt: list[int], max_tokens: int) -> dict:
    return {"type": "add", "id": request_id, "prompt": prompt, "params": ipc.params_to_dict(greedy(max_tokens))}


def test_a_failing_step_fails_the_live_requests_and_the_loop_goes_on(checkpoint):
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

    def send(frame: dict) -> None:
        frames.append(frame)
        # Stand in for the worker: after the failure, one more request; when it is done, end of socket.
        if any(kind == "unavailable" for _, kind, _ in frame["errors"]):
            commands.put(add("after", [4, 5, 6], 5))
        if any(out[0] == "after" and out[4] is not None for out in frame["outputs"]):
            commands.put(None)

    for command in (add("a", [1, 2, 3], 20), add("b", [7, 8], 20), add("oov", [VOCAB], 2)):
        commands.put(command)
    # On a thread only so that a loop that never gets its end of socket fails the test instead of hanging it.
    errors = []
    loop = threading.Thread(target=lambda: _run(EngineCore(engine, send, stats_interval_s=0), commands, errors),
                            daemon=True)
    loop.start()
    loop.join(60)
    assert not loop.is_alive() and not errors, errors

    assert frames[0]["errors"][0][:2] == ["oov", "invalid_argument"]
    assert [out[0] for out in frames[0]["outputs"]] == ["a", "b"]  # one frame per step, every sequence in it
    failed = next(f for f in frames if f["errors"] and f["errors"][0][1] == "unavailable")
    assert sorted((rid, kind) for rid, kind, _ in failed["errors"]) == [("a", "unavailable"), ("b", "unavailable")]
    assert "RuntimeError: kernel exploded" in failed["errors"][0][2]
    assert (failed["stats"]["running"], failed["stats"]["kv_blocks_used"]) == (0, 0)
    after = [out[1] for f in frames for out in f["outputs"] if out[0] == "after"]
    assert after == make_engine(checkpoint).generate([[4, 5, 6]], greedy(5))[0]
    assert frames[-1]["stats"]["adds_applied"] == 4 and frames[-1]["stats"]["kv_blocks_used"] == 0
    assert all(f["step_seconds"] is not None for f in frames if f["outputs"])


def _run(core: EngineCore, commands: queue.SimpleQueue, errors: list) -> None:
    try:
        core.run(commands)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(e)
