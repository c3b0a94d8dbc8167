"""The worker's engine client against a real engine-core process on the tiny checkpoint."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from rpcserver.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.core.client import EngineClient
from services.model_worker.core.process import CoreProcess, CoreStartError
from services.model_worker.server.metrics import EngineCollector
from tests.checkpoints import make_checkpoint
from tests.unit.test_batching import VOCAB, greedy, make_engine, requests

WAIT_S = 10  # bounded waits on conditions, never a measure of speed
START_S = 120  # a core's start: a fresh Python importing torch and loading the model, on a busy machine


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-engine-client")
    make_checkpoint(path, eos_token_id=())
    return path


def core_config(max_num_seqs: int = 16, max_waiting: int = 256) -> EngineConfig:
    # Must match tests.unit.test_batching.make_engine's defaults, the in-process reference.
    return EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=4,
                        limits=SchedulerLimits(max_num_seqs, 512, max_waiting))


def run_client(checkpoint, scenario, config: EngineConfig | None = None, **kwargs):
    """Start a client and its core, run `scenario(client)` and stop the core; returns the scenario's result."""
    async def main():
        client = EngineClient(checkpoint, config or core_config(), **kwargs)
        await asyncio.wait_for(client.start(), START_S)
        try:
            return await scenario(client)
        finally:
            await client.close()
            assert client.process.popen.poll() is not None, "close() left the engine core running"
    return asyncio.run(main())


async def eventually(condition, timeout: float = WAIT_S) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return condition()


async def collect(client: EngineClient, request_id: str, prompt, params) -> list[int]:
    return [out.token_id async for out in client.generate(request_id, prompt, params)]


def exported_restarts(client: EngineClient) -> float:
    """The restart counter as the worker's /metrics page shows it."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(EngineCollector(client))
    (line,) = [line for line in generate_latest(registry).decode().splitlines()
               if line.startswith("vllm_v0_worker_engine_core_restarts_total ")]
    return float(line.split()[1])


def test_streams_match_the_engine_and_the_full_queue_refuses_exactly_the_excess(checkpoint, capfd):
    reqs = [(list(range(10, 30)), greedy(150)), (list(range(40, 45)), greedy(150))] + requests(seed=6, count=4)
    reference = make_engine(checkpoint, prefix_caching=False)
    want = [reference.generate([prompt], params)[0] for prompt, params in reqs]

    async def scenario(client: EngineClient):
        async def one(i: int, prompt, params) -> list[int] | Exception:
            try:
                return await collect(client, f"r{i}", prompt, params)
            except ResourceExhausted as e:
                return e

        # Two long ones fill both running slots; then four at once: two wait, two are refused.
        long = [asyncio.create_task(one(i, *req)) for i, req in enumerate(reqs[:2])]
        assert await eventually(lambda: client.stats["running"] == 2)
        burst = [asyncio.create_task(one(i + 2, *req)) for i, req in enumerate(reqs[2:])]
        results = await asyncio.wait_for(asyncio.gather(*long, *burst), 120)
        assert await eventually(lambda: client.stats["kv_blocks_used"] == 0)
        return results, dict(client.stats)

    results, stats = run_client(checkpoint, scenario, core_config(max_num_seqs=2, max_waiting=2),
                                stats_interval_s=0.01)
    refused = [i for i, r in enumerate(results) if isinstance(r, ResourceExhausted)]
    assert refused == [4, 5]
    assert [r for i, r in enumerate(results) if i not in refused] == want[:4]
    assert (stats["running"], stats["waiting"], stats["kv_blocks_free"]) == (0, 0, 256)
    assert stats["adds_applied"] == 4
    # The periodic stats line comes from the core, whose stderr is the worker's.
    lines = [line for line in capfd.readouterr().err.splitlines() if "tokens/s generated" in line]
    assert lines and "KV blocks" in lines[0] and "prefix cache hit rate" in lines[0]


def test_cancelled_stream_frees_its_blocks_at_the_next_step(checkpoint):
    async def scenario(client: EngineClient):
        stream = client.generate("cancelled", list(range(40)), greedy(200))
        got = []
        async for out in stream:
            got.append(out.token_id)
            if len(got) == 3:
                break
        await stream.aclose()  # what grpc.aio does to the servicer's iterator when the caller goes
        assert await eventually(lambda: client.stats["running"] == 0 and client.stats["kv_blocks_used"] == 0)
        return got, dict(client.stats), client.tokens_after_cancel

    got, stats, after_cancel = run_client(checkpoint, scenario)
    assert len(got) == 3
    assert stats["kv_blocks_free"] == 256
    assert stats["steps"] < 200  # aborted, not run to its end
    # One token per step: besides the three read, some sat unread in the stream's queue, the rest came after it closed.
    assert 0 <= after_cancel <= stats["steps"] - 3


def test_bad_requests_are_invalid_argument_and_the_core_serves_on(checkpoint):
    async def scenario(client: EngineClient):
        with pytest.raises(InvalidArgument, match="outside the vocabulary"):
            await collect(client, "oov", [1, VOCAB + 5], greedy(4))
        with pytest.raises(InvalidArgument, match="exceeds the context"):
            await collect(client, "long", [1, 2, 3], greedy(10_000))
        first = client.generate("dup", [1, 2, 3], greedy(50))
        await first.__anext__()
        with pytest.raises(InvalidArgument, match="already generating"):
            await collect(client, "dup", [4, 5], greedy(2))
        await first.aclose()
        return await collect(client, "fine", [7, 8, 9], greedy(5)), client.serving

    tokens, serving = run_client(checkpoint, scenario)
    assert tokens == make_engine(checkpoint).generate([[7, 8, 9]], greedy(5))[0]
    assert serving


def test_killed_core_fails_open_streams_then_restarts_and_serves(checkpoint, caplog):
    """With --max-resumes 0 a dead core's streams fail (tests/unit/test_resume_core_death.py carries them on)."""
    serving_changes = []

    async def on_serving(serving: bool) -> None:
        serving_changes.append(serving)

    async def scenario(client: EngineClient):
        streams = [client.generate(f"s{i}", [i + 1, i + 2], greedy(400)) for i in range(3)]
        for stream in streams:
            await stream.__anext__()
        killed = client.process.pid
        os.kill(killed, signal.SIGKILL)

        async def ending(stream) -> BaseException | None:
            try:
                async for _ in stream:
                    pass
            except Unavailable as e:
                return e
            return None

        errors = await asyncio.wait_for(asyncio.gather(*(ending(s) for s in streams)), WAIT_S)
        assert all(isinstance(e, Unavailable) and "SIGKILL" in str(e) for e in errors), errors
        assert not client.serving and serving_changes == [True, False]
        with pytest.raises(Unavailable, match="restarting"):
            await collect(client, "too soon", [1, 2], greedy(2))

        assert await eventually(lambda: client.serving, START_S)
        assert client.process.pid != killed and serving_changes == [True, False, True]
        return await collect(client, "again", [3, 1, 4, 1, 5], greedy(8)), exported_restarts(client)

    with caplog.at_level(logging.ERROR, logger="services.model_worker.core.client"):
        tokens, restarts = run_client(checkpoint, scenario, on_serving=on_serving, max_resumes=0)
    assert tokens == make_engine(checkpoint).generate([[3, 1, 4, 1, 5]], greedy(8))[0]
    assert restarts == 1  # what the worker's /metrics says: one dead core, restarted
    assert any("was killed by SIGKILL" in r.getMessage() and "3 open streams" in r.getMessage()
               for r in caplog.records)


def test_an_error_outside_a_step_ends_the_core_loudly_like_a_death(checkpoint, capfd):
    async def scenario(client: EngineClient):
        stream = client.generate("open", [1, 2, 3], greedy(400))
        await stream.__anext__()
        client.process.send({"type": "no such command"})
        with pytest.raises(Unavailable, match="exited with code 1"):
            await asyncio.wait_for(collect_rest(stream), WAIT_S)
        return client.serving

    async def collect_rest(stream):
        async for _ in stream:
            pass

    assert run_client(checkpoint, scenario, restart_delay_s=(60.0, 60.0), max_resumes=0) is False
    err = capfd.readouterr().err
    assert "the engine core failed outside a step" in err and "unknown command 'no such command'" in err


def test_an_add_that_raises_a_non_service_error_fails_that_request_alone(checkpoint, capfd):
    """Whatever a request brings fails that request alone: INVALID_ARGUMENT naming the exception, its traceback
    logged, the stream beside it whole, the same core serving on, never restarted."""
    serving_changes = []

    async def on_serving(serving: bool) -> None:
        serving_changes.append(serving)

    async def scenario(client: EngineClient):
        core = client.process
        out: asyncio.Queue = asyncio.Queue()
        stream = client.generate("open", [1, 2, 3], greedy(40))
        first = await stream.__anext__()
        # A prompt of text, not ids: the engine's add raises TypeError, no ServiceError.
        client.submit("bad", "abc", greedy(2), out)
        error = await asyncio.wait_for(out.get(), WAIT_S)
        rest = [o.token_id async for o in stream]
        assert client.process is core and core.popen.poll() is None and client.serving
        return [first.token_id] + rest, error, client.restarts

    tokens, error, restarts = run_client(checkpoint, scenario, on_serving=on_serving, restart_delay_s=(0.05, 0.1))
    assert isinstance(error, InvalidArgument) and "TypeError" in str(error)
    assert tokens == make_engine(checkpoint).generate([[1, 2, 3]], greedy(40))[0]
    assert serving_changes == [True] and restarts == 0
    err = capfd.readouterr().err
    assert "request 1 could not be added" in err and "Traceback" in err and "TypeError" in err


def test_core_exits_when_the_worker_goes(checkpoint):
    async def scenario():
        for wait_for_ready in (True, False):  # the worker gone while serving, and while the model loads
            core = await CoreProcess.spawn(checkpoint, core_config(), "info", 0)
            if wait_for_ready:
                assert (await asyncio.wait_for(core.wait_ready(), START_S))["type"] == "ready"
            core.close_socket()
            assert await core.wait_exit(START_S) == 0
    asyncio.run(scenario())


def test_a_core_that_cannot_load_fails_the_start(checkpoint, tmp_path):
    for name in ("config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())

    async def scenario():
        client = EngineClient(tmp_path, core_config())
        with pytest.raises(CoreStartError, match="safetensors"):
            await asyncio.wait_for(client.start(), START_S)
        assert client.process.popen.poll() == 1 and not client.serving
    asyncio.run(scenario())


def test_a_draining_client_refuses_new_requests_and_finishes_open_ones(checkpoint):
    async def scenario(client: EngineClient):
        open_stream = client.generate("open", [1, 2, 3], greedy(20))
        first = await open_stream.__anext__()
        await client.drain()
        with pytest.raises(Unavailable, match="shutting down"):
            await collect(client, "late", [4, 5], greedy(2))
        return [first.token_id] + [out.token_id async for out in open_stream]

    tokens = run_client(checkpoint, scenario)
    assert tokens == make_engine(checkpoint).generate([[1, 2, 3]], greedy(20))[0]


def test_a_hung_core_is_killed_after_the_step_timeout_and_restarted(checkpoint, caplog):
    """A core that stops making steps with requests open (SIGSTOP here; a stuck device in life) is taken as dead."""
    serving_changes = []

    async def on_serving(serving: bool) -> None:
        serving_changes.append(serving)

    async def scenario(client: EngineClient):
        idle = client.process
        await asyncio.sleep(2.5)  # no requests open: silence is no hang
        assert client.process is idle and client.serving
        stream = client.generate("open", [1, 2, 3], greedy(400))
        await stream.__anext__()
        hung = client.process
        os.kill(hung.pid, signal.SIGSTOP)
        with pytest.raises(Unavailable, match=r"made no step for \d+ s with 1 requests open \(--step-timeout\)"):
            await asyncio.wait_for(collect_rest(stream), WAIT_S)
        assert hung.popen.returncode == -signal.SIGKILL
        assert await eventually(lambda: client.serving, START_S)
        assert serving_changes == [True, False, True] and client.process is not hung
        return await collect(client, "again", [3, 1, 4], greedy(6))

    async def collect_rest(stream):
        async for _ in stream:
            pass

    with caplog.at_level(logging.ERROR, logger="services.model_worker.core.client"):
        tokens = run_client(checkpoint, scenario, on_serving=on_serving, restart_delay_s=(0.05, 0.1),
                            step_timeout_s=1.0, max_resumes=0)
    assert tokens == make_engine(checkpoint).generate([[3, 1, 4]], greedy(6))[0]
    assert any("its threads' stacks follow, then it is killed" in r.getMessage() for r in caplog.records)
