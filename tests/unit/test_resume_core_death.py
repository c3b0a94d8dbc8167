"""The worker carries its open streams on when its engine core dies: each sink sees one stream, with exactly the
tokens an unbroken run gives, against a real engine-core process on the tiny checkpoint."""
from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from rpcserver.errors import Unavailable
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core import client as client_module
from services.model_worker.core import process as process_module
from services.model_worker.core.client import EngineClient
from services.model_worker.server.metrics import EngineCollector
from tests.checkpoints import make_checkpoint
from tests.unit.test_batching import greedy, make_engine
from tests.unit.test_engine_client import START_S, WAIT_S, eventually, run_client

LENGTH = 150
WORKER_SEED = 777  # what the worker draws as the seed of an unseeded sampled request, fixed here


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-resume-core-death")
    make_checkpoint(path, eos_token_id=())
    return path


def sampled(seed: int | None) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, seed=seed, max_tokens=LENGTH, ignore_eos=True)


class Stream:
    """A request read into a list as its tokens come, with how it ended."""

    def __init__(self, client: EngineClient, request_id: str, prompt: list[int], params: SamplingParams):
        self.outputs = []
        self.error: BaseException | None = None
        self.iterator = client.generate(request_id, prompt, params)
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for out in self.iterator:
                self.outputs.append(out)
        except Unavailable as e:
            self.error = e

    @property
    def tokens(self) -> list[int]:
        return [out.token_id for out in self.outputs]


def exported(client: EngineClient) -> dict[str, float]:
    """The resume counters as the worker's /metrics page shows them."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(client))
    return {line.split()[0]: float(line.split()[1]) for line in generate_latest(registry).decode().splitlines()
            if line.startswith("vllm_v0_worker_resumes")}


def test_streams_go_on_exactly_on_the_new_core(checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(client_module, "fresh_seed", lambda: WORKER_SEED)
    caplog.set_level(logging.INFO)
    requests = {"greedy-a": ([5, 6, 7], greedy(LENGTH)), "greedy-b": ([40, 41], greedy(LENGTH)),
                "seeded-a": ([9, 10, 11, 12], sampled(11)), "seeded-b": ([9, 10], sampled(12)),
                "unseeded": ([70, 71, 72], sampled(None)),
                "logprobs": ([3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True,
                                                             logprobs=2, prompt_logprobs=2)),
                "late": ([8, 8, 9], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=1))}
    reference = make_engine(checkpoint)
    want = {}
    for name, (prompt, params) in requests.items():
        reference.add_request(name, prompt, params if params.seed is not None or params.is_greedy
                              else sampled(WORKER_SEED))
        want[name] = []
        while reference.has_work():
            want[name] += reference.step()
    serving_changes = []

    async def on_serving(serving: bool) -> None:
        serving_changes.append(serving)

    async def scenario(client: EngineClient):
        streams = {name: Stream(client, name, *requests[name]) for name in requests if name != "late"}
        cancelled = Stream(client, "cancelled", [1, 2, 3], greedy(LENGTH))
        assert await eventually(lambda: all(len(s.outputs) >= 3 for s in [*streams.values(), cancelled]))
        # Submitted and killed with no await between: the late stream never had a token from the dead core.
        streams["late"] = Stream(client, "late", *requests["late"])
        killed = client.process.pid
        os.kill(killed, signal.SIGKILL)
        at_death = {name: len(s.outputs) for name, s in streams.items()}
        assert await eventually(lambda: not client.serving)
        cancelled.task.cancel()  # the caller goes while its stream waits for the new core
        await asyncio.gather(cancelled.task, return_exceptions=True)
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams.values())), START_S)
        assert client.process.pid != killed and serving_changes == [True, False, True]
        assert await eventually(lambda: client.stats["running"] == 0 and client.stats["kv_blocks_used"] == 0)
        return streams, at_death, dict(client.stats), exported(client)

    streams, at_death, stats, metrics = run_client(checkpoint, scenario, on_serving=on_serving,
                                                   restart_delay_s=(0.05, 0.1))
    for name, stream in streams.items():
        assert stream.error is None, (name, stream.error)
        assert stream.tokens == [out.token_id for out in want[name]], name
        assert 0 <= at_death[name] < len(want[name]) - 10, name  # it died mid-stream
    assert at_death["late"] == 0
    # The stream that had its first token got its prompt logprobs then, once; the late one from the new core.
    got_prompt_logprobs = [i for i, out in enumerate(streams["logprobs"].outputs) if out.prompt_logprobs is not None]
    assert got_prompt_logprobs == [0]
    late = streams["late"].outputs[0].prompt_logprobs
    for got, expected in zip(late, want["late"][0].prompt_logprobs, strict=True):
        assert (got is None) == (expected is None)
        if got is not None:
            assert got[0] == pytest.approx(expected[0], abs=1e-4)
    for got, expected in zip(streams["logprobs"].outputs, want["logprobs"]):
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)
    # The new core was given the open streams and nothing for the one cancelled while it waited.
    assert stats["adds_applied"] == len(streams)
    assert metrics['vllm_v0_worker_resumes_total{cause="engine_core"}'] == len(streams)
    assert metrics['vllm_v0_worker_resumes_abandoned_total{reason="limit"}'] == 0
    assert metrics['vllm_v0_worker_resumes_abandoned_total{reason="wait"}'] == 0
    resumed = [r.getMessage() for r in caplog.records if "carried on by the engine core" in r.getMessage()]
    assert len(resumed) == len(streams) and all("(pid " in line for line in resumed)
    assert any("request greedy-a: carried on" in line for line in resumed)


def test_a_stream_is_carried_on_at_most_max_resumes_times(checkpoint):
    async def scenario(client: EngineClient):
        stream = Stream(client, "twice", [1, 2], greedy(LENGTH))
        assert await eventually(lambda: len(stream.outputs) >= 3)
        for _ in range(2):
            os.kill(client.process.pid, signal.SIGKILL)
            assert await eventually(lambda: not client.serving)
            assert await eventually(lambda: client.serving, START_S)
            if stream.task.done():
                break
        await asyncio.wait_for(stream.task, WAIT_S)
        return stream, exported(client)

    stream, metrics = run_client(checkpoint, scenario, restart_delay_s=(0.05, 0.1), max_resumes=1)
    assert isinstance(stream.error, Unavailable) and "SIGKILL" in str(stream.error)
    assert "carried on to a new engine core 1 times, the most --max-resumes allows" in str(stream.error)
    # What it had before the second death is the unbroken run's start, nothing repeated.
    want = make_engine(checkpoint).generate([[1, 2]], greedy(LENGTH))[0]
    assert 3 <= len(stream.tokens) < LENGTH and stream.tokens == want[:len(stream.tokens)]
    assert metrics['vllm_v0_worker_resumes_total{cause="engine_core"}'] == 1
    assert metrics['vllm_v0_worker_resumes_abandoned_total{reason="limit"}'] == 1


def test_a_stream_fails_when_no_core_is_back_within_the_resume_wait(checkpoint):
    async def scenario(client: EngineClient):
        stream = Stream(client, "waits", [1, 2], greedy(LENGTH))
        assert await eventually(lambda: len(stream.outputs) >= 3)
        os.kill(client.process.pid, signal.SIGKILL)
        await asyncio.wait_for(stream.task, WAIT_S)  # the restart is 60 s away: only the wait can end it
        return stream, client.serving, exported(client)

    stream, serving, metrics = run_client(checkpoint, scenario, restart_delay_s=(60.0, 60.0), resume_wait_s=0.5)
    assert isinstance(stream.error, Unavailable) and not serving
    assert "no new engine core was ready within 0.5 s (--resume-wait)" in str(stream.error)
    assert metrics['vllm_v0_worker_resumes_abandoned_total{reason="wait"}'] == 1
    assert metrics['vllm_v0_worker_resumes_total{cause="engine_core"}'] == 0


FAILING_ONCE = """
import os, sys
from services.model_worker.core import engine_core
from services.model_worker.engine.llm_engine import LLMEngine

real_step, steps = LLMEngine.step, []

def step(self):
    steps.append(1)
    if len(steps) == 20 and not os.path.exists(os.environ["FAIL_ONCE_MARKER"]):
        open(os.environ["FAIL_ONCE_MARKER"], "w").close()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return real_step(self)

LLMEngine.step = step
sys.exit(engine_core.main(sys.argv[1:]))
"""


def test_streams_go_on_after_a_failed_step_ends_the_core(checkpoint, monkeypatch, tmp_path, caplog):
    """The core's last frame fails every open request UNAVAILABLE and says it is dying: the worker carries the
    streams on instead, and says why the core died."""
    real_popen = process_module.subprocess.Popen

    def popen(args, **kwargs):  # the real core's main, with its 20th step failing in the first core only
        if "services.model_worker.core.engine_core" in args:
            at = args.index("-m")
            args = [*args[:at], "-c", FAILING_ONCE, *args[at + 2:]]
        return real_popen(args, **kwargs)

    monkeypatch.setattr(process_module.subprocess, "Popen", popen)
    monkeypatch.setenv("FAIL_ONCE_MARKER", str(tmp_path / "failed"))

    async def scenario(client: EngineClient):
        streams = [Stream(client, f"s{i}", [i + 1, i + 2], greedy(LENGTH)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), START_S)
        return streams

    streams = run_client(checkpoint, scenario, restart_delay_s=(0.05, 0.1))
    assert (tmp_path / "failed").exists()
    reference = make_engine(checkpoint)
    for i, stream in enumerate(streams):
        assert stream.error is None and stream.tokens == reference.generate([[i + 1, i + 2]], greedy(LENGTH))[0]
    assert any("exited with code 4 after a failed step (RuntimeError: CUDA error: an illegal memory access" in
               r.getMessage() and "2 open streams wait for the next engine core" in r.getMessage()
               for r in caplog.records)
