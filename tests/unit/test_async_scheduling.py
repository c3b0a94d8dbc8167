"""Asynchronous scheduling (each step's tokens read back one step late, feeding the next step on the device)
produces the same tokens as reading every step back at once, over one mixed workload: staggered arrivals,
shared prefixes (prefix hits), chunked prefill, preemption, cancellation, grammars, penalties, seeded sampling,
stop ids that end sequences a step late, logprobs, and speculative decoding."""
from __future__ import annotations

import random

import pytest

from demo.vocab import write_tokenizer_files
from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams, StructuredOutput
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

VOCAB = 2048  # the real vocabulary's first ids are enough for the prompts; grammars need its tokenizer files
EOS = (151645, 151643)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-async")
    write_tokenizer_files(path)
    make_checkpoint(path, vocab_size=151936, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, eos_token_id=EOS)
    return path


def engine(checkpoint, async_scheduling: bool, speculative: SpeculativeConfig | None = None) -> LLMEngine:
    # Few blocks (preemption), a small step budget (chunked prefill), prefix caching on.
    return LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=30, block_size=4, async_scheduling=async_scheduling,
        limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=24), speculative=speculative))


def workload(seed: int, stop_ids: list[int]) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(13)]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=rng.randrange(1 << 30)),
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=rng.randrange(1 << 30), logprobs=2),
        dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=1.0, seed=rng.randrange(1 << 30), frequency_penalty=0.8, min_p=0.05),
        dict(temperature=0.0, structured_output=StructuredOutput("regex", "[a-c]{3,9}x")),
        dict(temperature=0.7, seed=rng.randrange(1 << 30),
             structured_output=StructuredOutput.choice(["alpha", "beta gamma", "delta"])),
        dict(temperature=0.0, stop_token_ids=tuple(stop_ids), logprobs=0),
    ]
    requests = []
    for i in range(16):
        prefix = shared if i % 3 == 0 else []
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        requests.append((prompt, SamplingParams(max_tokens=rng.randrange(8, 48), **kinds[i % len(kinds)])))
    return requests


def run(engine: LLMEngine, requests, seed: int, cancel_after: dict[int, int]) -> dict[int, list]:
    """Adds the requests a few at a time between steps; cancels request i once it has cancel_after[i] tokens.
    Returns each request's (token, logprob, top logprobs, finish reason) outputs."""
    rng = random.Random(seed)
    queued = list(enumerate(requests))
    got: dict[int, list] = {i: [] for i in range(len(requests))}
    live: set[int] = set()
    while queued or engine.has_work():
        for _ in range(min(len(queued), rng.choice([0, 1, 2, 4]))):
            i, (prompt, params) = queued.pop(0)
            engine.add_request(f"r{i}", prompt, params)
            live.add(i)
        cancelled = []
        for out in engine.step():  # one call may carry two tokens of a sequence: the late one, then its next
            i = int(out.request_id[1:])
            if i in cancelled:
                continue  # the client has gone; the tokens it cancelled in the middle of are never compared
            assert i in live, f"a token for {out.request_id} after it ended"
            got[i].append((out.token_id, out.logprob, out.top_logprobs, out.finish_reason))
            if out.finish_reason is not None:
                live.discard(i)
            elif len(got[i]) == cancel_after.get(i):
                cancelled.append(i)
        for i in cancelled:  # between steps, as the engine core applies an abort
            assert engine.abort(f"r{i}")
            live.discard(i)
    assert not live
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return got


def stop_ids_met(checkpoint) -> list[int]:
    """Ids the greedy stop-id request emits midway when run alone, so that its stop ends it a step late."""
    alone = engine(checkpoint, async_scheduling=False)
    prompt, params = workload(0, [])[7]
    out = alone.generate([prompt], params)[0]
    return [out[len(out) // 2]]


@pytest.mark.parametrize("seed", [0, 1])
def test_async_scheduling_changes_no_token(checkpoint, seed):
    requests = workload(seed, stop_ids_met(checkpoint))
    cancel_after = {1: 2, 4: 3, 9: 1}
    sync = run(engine(checkpoint, async_scheduling=False), requests, seed, cancel_after)
    overlapped = engine(checkpoint, async_scheduling=True)
    asynchronous = run(overlapped, requests, seed, cancel_after)
    assert overlapped.scheduler.num_preemptions > 0, "the workload must preempt"
    assert overlapped.block_manager.prefix_hits > 0, "the workload must hit the prefix cache"
    assert any(out[-1][3] is not None and out[-1][3].value == "eos" for out in sync.values()), \
        "some request must end on a stop id, which the host learns a step late"
    for i in sync:
        assert [o[0] for o in asynchronous[i]] == [o[0] for o in sync[i]], f"request {i}"
        assert [o[3] for o in asynchronous[i]] == [o[3] for o in sync[i]]
        for a, b in zip(asynchronous[i], sync[i]):
            if a[1] is not None:
                assert a[1] == pytest.approx(b[1], abs=1e-4)
                assert [t for t, _ in a[2]] == [t for t, _ in b[2]]


def test_async_steps_overlap_reading_back(checkpoint):
    """With it on, a step's tokens come out of the next call (after that call has launched its own step)."""
    overlapped = engine(checkpoint, async_scheduling=True)
    overlapped.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert overlapped.step() == []  # the prefill's token is still in flight
    assert overlapped._in_flight is not None
    first = overlapped.step()
    assert [o.request_id for o in first] == ["a"]
    reference = engine(checkpoint, async_scheduling=False).generate([[5, 6, 7]], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    rest = []
    while overlapped.has_work():
        rest += overlapped.step()
    assert [o.token_id for o in first + rest] == reference
    assert rest[-1].finish_reason.value == "length"


def test_speculation_matches_with_async_scheduling_asked(checkpoint):
    """Speculative decoding proposes from the newest ids on the host: asked for, async scheduling stays out of its
    way and the tokens are those of plain greedy decoding."""
    requests = [(prompt, SamplingParams(temperature=0.0, max_tokens=12)) for prompt, _ in workload(3, [])[:6]]
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3)
    with_spec = run(engine(checkpoint, async_scheduling=True, speculative=spec), requests, 3, {})
    plain = run(engine(checkpoint, async_scheduling=False), requests, 3, {})
    assert {i: [o[0] for o in v] for i, v in with_spec.items()} == {i: [o[0] for o in v] for i, v in plain.items()}
