"""Continuous batching in the engine: requests joining at different steps produce what each produces alone."""
from __future__ import annotations

import random

import pytest

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

VOCAB = 512  # tests.checkpoints.TINY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-batching")
    make_checkpoint(path, eos_token_id=())
    return path


def make_engine(checkpoint, num_blocks: int = 256, block_size: int = 4, max_num_seqs: int = 16,
                max_num_batched_tokens: int = 512, prefix_caching: bool = True,
                policy: str = "shortest-first", async_scheduling: bool | None = None) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=num_blocks, block_size=block_size,
        enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
        limits=SchedulerLimits(max_num_seqs, max_num_batched_tokens, policy=policy)))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def requests(seed: int, count: int = 16) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 50))], greedy(rng.randrange(1, 24)))
            for _ in range(count)]


def alone(engine: LLMEngine, reqs) -> list[list[int]]:
    return [engine.generate([prompt], params)[0] for prompt, params in reqs]


def run_staggered(engine: LLMEngine, reqs, seed: int) -> list[list[int]]:
    """Add the requests a few at a time with steps in between; check each step's token accounting."""
    rng = random.Random(seed)
    pending = list(enumerate(reqs))
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    while pending or engine.has_work():
        for _ in range(min(len(pending), rng.choice([0, 0, 1, 3]))):
            i, (prompt, params) = pending.pop(0)
            engine.add_request(f"req-{i}", prompt, params)
            outputs[f"req-{i}"] = []
        if not engine.has_work():
            continue
        # Every sequence past its prefill is owed exactly one token this step (unless preempted by it); with
        # asynchronous scheduling, every one with a token in flight (read back after the next step launches).
        if engine.async_scheduling:
            owed = {s.request_id for s in engine.scheduler.running if s.num_pending}
        else:
            owed = {s.request_id for s in engine.scheduler.running if s.num_uncached_tokens == 1}
        preemptions = engine.scheduler.num_preemptions
        step = engine.step()
        got = [out.request_id for out in step]
        assert len(got) == len(set(got))
        if engine.scheduler.num_preemptions == preemptions:
            assert owed <= set(got)
        for out in step:
            assert out.request_id not in finished
            outputs[out.request_id].append(out.token_id)
            if out.finish_reason is not None:
                finished.add(out.request_id)
    assert finished == set(outputs)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return [outputs[f"req-{i}"] for i in range(len(reqs))]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Each request alone, in an engine without prefix caching."""
    engine = make_engine(checkpoint, prefix_caching=False, async_scheduling=False)
    return lambda reqs: alone(engine, reqs)


# Admission order changes which requests share a step, never what any of them produces; nor does reading a step's
# tokens back one step late (asynchronous scheduling) against the reference's reading each step's back at once.
POLICIES = pytest.mark.parametrize("policy,async_scheduling", [("shortest-first", True), ("fcfs", True),
                                                                ("shortest-first", False)])


@POLICIES
def test_staggered_requests_match_each_alone(checkpoint, reference, policy, async_scheduling):
    reqs = requests(seed=1)
    engine = make_engine(checkpoint, policy=policy, async_scheduling=async_scheduling)
    together = run_staggered(engine, reqs, seed=1)
    assert together == reference(reqs)
    assert [len(out) for out in together] == [p.max_tokens for _, p in reqs]
    assert len({tuple(out) for out in together}) == len(reqs)  # a degenerate model would prove nothing


@POLICIES
def test_chunked_prefill_matches(checkpoint, reference, policy, async_scheduling):
    reqs = requests(seed=2)
    # Prompts of up to 49 tokens: 4 chunks.
    engine = make_engine(checkpoint, max_num_batched_tokens=16, policy=policy, async_scheduling=async_scheduling)
    assert run_staggered(engine, reqs, seed=2) == reference(reqs)


@POLICIES
def test_preemption_matches(checkpoint, reference, policy, async_scheduling):
    reqs = requests(seed=3)
    # 96 token slots for 16 requests of up to 72 tokens.
    engine = make_engine(checkpoint, num_blocks=24, policy=policy, async_scheduling=async_scheduling)
    assert run_staggered(engine, reqs, seed=3) == reference(reqs)
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("budget", [512, 8])
def test_prefix_cache_hits_match_no_cache(checkpoint, reference, budget):
    rng = random.Random(4)
    prefix = [rng.randrange(VOCAB) for _ in range(40)]
    reqs = [(prefix + [rng.randrange(VOCAB) for _ in range(n)], greedy(12)) for n in (3, 7, 1, 5)]
    want = reference(reqs)
    engine = make_engine(checkpoint, max_num_seqs=4, max_num_batched_tokens=budget)

    # After the first has finished: its blocks sit free but cached.
    assert engine.generate([reqs[0][0]], reqs[0][1]) == [want[0]]
    hits = engine.block_manager.prefix_hits
    assert engine.generate([reqs[1][0]], reqs[1][1]) == [want[1]]
    assert engine.block_manager.prefix_hits - hits == 40  # every full block of the shared prefix

    # While the first is still running (in a fresh engine): its blocks are shared.
    engine = make_engine(checkpoint, max_num_seqs=4, max_num_batched_tokens=budget)
    engine.add_request("a", *reqs[2])
    out = {"a": [], "b": []}
    for _ in range(8):
        for o in engine.step():
            out[o.request_id].append(o.token_id)
    assert engine.block_manager.prefix_hits == 0
    engine.add_request("b", *reqs[3])
    shared = None
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].append(o.token_id)
        if shared is None:
            tables = {s.request_id: s.block_table for s in engine.scheduler.running}
            shared = set(tables["a"]) & set(tables["b"])
    assert engine.block_manager.prefix_hits == 40
    assert len(shared) == 40 // engine.block_manager.block_size
    assert [out["a"], out["b"]] == want[2:]
    assert engine.block_manager.hit_rate > 0


def test_seeded_sampling_is_independent_of_the_batch(checkpoint):
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = list(range(30, 47))
    engine = make_engine(checkpoint)
    (by_itself,) = engine.generate([prompt], sampled)
    others = [(p, SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=15, ignore_eos=True) if i % 2
               else params) for i, (p, params) in enumerate(requests(seed=5, count=6))]
    for chunked in (False, True):
        engine = make_engine(checkpoint, max_num_seqs=8, max_num_batched_tokens=8 if chunked else 512)
        engine.add_request("early", *others[0])
        engine.step()
        engine.step()
        batch = engine.generate([prompt] + [p for p, _ in others[1:]], [sampled] + [s for _, s in others[1:]])
        assert batch[0] == by_itself
    # Sampling really samples: another seed draws other tokens.
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20, ignore_eos=True)
    assert make_engine(checkpoint).generate([prompt], other_seed)[0] != by_itself
