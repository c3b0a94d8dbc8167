"""Speculative decoding (prompt lookup): greedy output equals plain greedy, sampled output keeps its distribution,
and the block manager ends where a plain run does."""
from __future__ import annotations

import random

import pytest
import torch

from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.executor.spec import ngram, rejection
from tests.checkpoints import make_checkpoint

VOCAB = 512  # tests.checkpoints.TINY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-speculative")
    model = make_checkpoint(path, eos_token_id=(7,))
    # The draft model: the same weights, perturbed, so that it agrees with the target often but not always.
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.15 * param.std())
    draft = tmp_path_factory.mktemp("tiny-speculative-draft")
    model.save_pretrained(draft)
    DRAFT[path] = draft
    return path


DRAFT: dict = {}  # target checkpoint -> its draft checkpoint
METHODS = ["ngram", "draft"]


def make_engine(checkpoint, spec: bool | str, num_blocks: int = 256, max_num_batched_tokens: int = 512, k: int = 4,
                fixed_k: bool = False, max_num_seqs: int = 16) -> LLMEngine:
    method = "ngram" if spec is True else spec
    speculative = SpeculativeConfig(method, num_speculative_tokens=k, ngram_min=1, ngram_max=3, fixed_k=fixed_k,
                                    disable_batch_size=64,
                                    draft_model=str(DRAFT[checkpoint]) if method == "draft" else None
                                    ) if spec else None
    return LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=num_blocks, block_size=4,
        limits=SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_waiting=512), speculative=speculative))


# -- the proposer ---------------------------------------------------------------------------------------------


def naive_propose(tokens, k, n_min, n_max):
    """Straight from the definition: the longest suffix seen before; its latest occurrence followed by k tokens,
    else its latest occurrence."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(tokens)]
            i = (full or starts)[-1]
            return tokens[i + n:i + n + k]
    return []


def test_ngram_proposals_match_the_definition():
    rng = random.Random(1)
    for _ in range(300):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 40))]
        k, n_min = rng.randrange(1, 6), rng.randrange(1, 4)
        n_max = n_min + rng.randrange(0, 3)
        assert ngram.propose(tokens, k, n_min, n_max) == naive_propose(tokens, k, n_min, n_max)
    assert ngram.propose([5, 6, 7, 8, 5, 6], 3, 2, 2) == [7, 8, 5]
    assert ngram.propose([1, 2, 3], 3, 1, 3) == []


# -- greedy: token for token what plain decoding emits ---------------------------------------------------------


@pytest.fixture(scope="module")
def plain(checkpoint):
    """The reference: the same engine without speculation."""
    return make_engine(checkpoint, spec=False, max_num_batched_tokens=2048, max_num_seqs=400)


def prompts_with_repeats(plain: LLMEngine, count: int, seed: int) -> list[list[int]]:
    """Random prompts, half of them a seed and the tiny model's own greedy continuation (so that the
    continuation's spans recur and proposals get accepted), some sharing prefixes (prefix-cache hits)."""
    rng = random.Random(seed)
    seeds = [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 12))] for _ in range(count // 2)]
    grown = plain.generate(seeds, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    prompts = [s + g for s, g in zip(seeds, grown)]
    while len(prompts) < count:
        if rng.random() < 0.3:  # a shared prefix
            prompts.append(rng.choice(prompts)[:rng.randrange(4, 20)] + [rng.randrange(VOCAB)])
        else:
            prompts.append([rng.randrange(16) for _ in range(rng.randrange(1, 40))])
    rng.shuffle(prompts)
    return prompts


def run_staggered(engine: LLMEngine, reqs, seed: int, cancel: set[int] = frozenset()) -> dict[int, list[int]]:
    """Adds requests a few at a time, cancels some mid-stream; returns what each streamed."""
    rng = random.Random(seed)
    pending = list(enumerate(reqs))
    outputs: dict[int, list[int]] = {}
    while pending or engine.has_work():
        for _ in range(min(len(pending), rng.choice([0, 1, 1, 4]))):
            i, (prompt, params) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
            outputs[i] = []
        for i in list(outputs):
            if i in cancel and len(outputs[i]) >= 3 and f"r{i}" in engine._seqs:
                engine.abort(f"r{i}")
        if not engine.has_work():
            continue
        for out in engine.step():
            outputs[int(out.request_id[1:])].append(out.token_id)
    assert engine.block_manager.num_free == engine.block_manager.num_blocks
    return outputs


@pytest.mark.parametrize("method, count, fixed_k, num_blocks, budget",
                         [("ngram", 50, False, 20, 32), ("ngram", 16, True, 256, 64), ("draft", 50, False, 20, 32)],
                         ids=["ngram-adaptive-k", "ngram-fixed-k", "draft-adaptive-k"])
def test_greedy_equals_plain_greedy(checkpoint, plain, method, count, fixed_k, num_blocks, budget):
    """Mixed batches (requests join every few steps), prompts prefilled in chunks, prefix hits, preemptions
    (a small cache), cancelled streams, stop ids."""
    prompts = prompts_with_repeats(plain, count, seed=2)
    rng = random.Random(3)
    reqs = [(p, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 14), ignore_eos=rng.random() < 0.7))
            for p in prompts]
    expected = plain.generate([p for p, _ in reqs], [s for _, s in reqs])
    spec = make_engine(checkpoint, spec=method, num_blocks=num_blocks, max_num_batched_tokens=budget, fixed_k=fixed_k)
    cancel = set(rng.sample(range(len(reqs)), 5))
    got = run_staggered(spec, reqs, seed=4, cancel=cancel)
    for i, tokens in got.items():
        if i in cancel:
            assert tokens == expected[i][:len(tokens)], i
        else:
            assert tokens == expected[i], i
    stats = spec.stats()
    # Both paths ran: proposals accepted (tokens for free) and rejected (rolled back).
    assert 0 < stats["spec_accepted"] < stats["spec_proposed"]
    if num_blocks < 100:
        assert stats["preemptions"] > 0
        assert spec.block_manager.hit_rate > 0


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_penalties_and_logprobs_equals_plain(checkpoint, plain, method):
    """Each verified row's penalties count the proposals before it as output."""
    prompts = prompts_with_repeats(plain, 12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.02,
                            frequency_penalty=0.05, presence_penalty=0.02, logprobs=3)

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        outs = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_work():
            for o in engine.step():
                outs[o.request_id].append((o.token_id, o.logprob, [t for t, _ in o.top_logprobs]))
        return outs

    spec = make_engine(checkpoint, spec=method)
    got, want = run(spec), run(plain)
    for rid in want:
        assert [(t, top) for t, _, top in got[rid]] == [(t, top) for t, _, top in want[rid]]
        # A verified row's logits come from a query of several rows: equal up to float32 rounding.
        assert [lp for _, lp, _ in got[rid]] == pytest.approx([lp for _, lp, _ in want[rid]], abs=1e-4)
    assert spec.stats()["spec_accepted"] > 0


# -- blocks and prefix hashes ----------------------------------------------------------------------------------


def states_by_length(engine: LLMEngine, prompt: list[int], max_tokens: int) -> dict[int, tuple]:
    """After each step: output length -> (free blocks, the sequence's blocks, the registered prefix hashes)."""
    seq = engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    states = {}
    while engine.has_work():
        engine.step()
        if not seq.is_finished:
            states[len(seq.output_ids)] = (engine.block_manager.num_free, len(seq.block_table),
                                           frozenset(engine.block_manager.cached), seq.num_cached_tokens)
    states["end"] = (engine.block_manager.num_free, frozenset(engine.block_manager.cached))
    return states


@pytest.mark.parametrize("method", METHODS)
def test_blocks_and_prefix_hashes_after_rejections_equal_a_plain_run(checkpoint, plain, method):
    prompts = prompts_with_repeats(plain, 6, seed=6)[:3 if method == "ngram" else 2]
    spec, fresh = make_engine(checkpoint, spec=method, fixed_k=True, k=5), make_engine(checkpoint, spec=False)
    for prompt in prompts:
        got, want = states_by_length(spec, prompt, 24), states_by_length(fresh, prompt, 24)
        common = [n for n in got if n in want]
        assert len(common) > 3
        for n in common:
            assert got[n] == want[n], n
    assert 0 < spec.speculator.num_accepted < spec.speculator.num_proposed  # accepted and rejected proposals


# -- sampling: the distribution is unchanged -------------------------------------------------------------------


def chi_square_p(a: list[int], b: list[int]) -> float:
    """Two-sample chi-square test of homogeneity over the categories seen; the p-value."""
    cats = sorted(set(a) | set(b))
    table = torch.tensor([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = len(cats) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_rejection_sampler_alone_keeps_the_target_distribution():
    """The verifier's first emitted token against the target itself, for a point-mass and a drawn proposal."""
    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    draft_q = torch.tensor([[0.1, 0.1, 0.7, 0.1]])
    n = 4000
    for q in (None, draft_q):
        firsts = []
        for i in range(n):
            proposal = 2 if q is None else int(torch.multinomial(draft_q[0], 1, generator=gen))
            firsts.append(rejection.verify(target, [proposal], q, (0, i))[0])  # one seed, successive indices
        counts = torch.tensor([firsts.count(t) for t in range(4)], dtype=torch.float64)
        stat = ((counts - n * target[0].double()) ** 2 / (n * target[0].double())).sum()
        assert float(torch.special.gammaincc(torch.tensor(1.5, dtype=torch.float64), stat / 2)) > 0.01


@pytest.mark.parametrize("method", METHODS)
def test_sampled_tokens_keep_their_distribution(checkpoint, plain, method):
    """Per output position, speculative and plain draws are indistinguishable (p > 0.01): independent samples
    (different seeds) of the same request, 300 each."""
    spec = make_engine(checkpoint, spec=method, max_num_batched_tokens=2048, max_num_seqs=400, fixed_k=True, k=3)
    # A prompt whose tail occurred before, followed by the model's own likeliest tokens there (iterated to a
    # near fixed point): proposals come at most steps and are accepted about a quarter of the time.
    rng = random.Random(8)
    head = [rng.randrange(VOCAB) for _ in range(6)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    follow = plain.generate([head + head], greedy)[0]
    for _ in range(3):
        follow = plain.generate([head + follow + head], greedy)[0]
    prompt = head + follow + head
    n = 300

    def params(first_seed):
        return [SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True, seed=first_seed + s)
                for s in range(n)]

    a = plain.generate([prompt] * n, params(0))
    b = spec.generate([prompt] * n, params(n))
    stats = spec.stats()
    assert stats["spec_accepted"] > 50 and stats["spec_proposed"] - stats["spec_accepted"] > 50
    for position in range(4):
        assert chi_square_p([t[position] for t in a], [t[position] for t in b]) > 0.01, position
    assert spec.generate([prompt] * 20, params(n)[:20]) == b[:20]  # seeded: reproducible


# -- flags ------------------------------------------------------------------------------------------------------


def test_the_worker_flags_reach_the_engine_config_and_bad_ones_are_refused(capsys):
    from services.model_worker.main import engine_config, parse_args

    spec = engine_config(parse_args(["--speculative-method", "draft", "--speculative-model", "/models/small",
                                     "--num-speculative-tokens", "6", "--speculative-fixed-k",
                                     "--speculative-disable-batch-size", "3"])).speculative
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens, spec.fixed_k, spec.disable_batch_size) == \
        ("draft", "/models/small", 6, True, 3)
    spec = engine_config(parse_args(["--speculative-method", "ngram", "--ngram-min", "1", "--ngram-max", "5"])).speculative
    assert (spec.method, spec.ngram_min, spec.ngram_max, spec.draft_model) == ("ngram", 1, 5, None)
    assert not engine_config(parse_args([])).speculative.enabled
    for argv, needle in ((["--speculative-method", "draft"], "needs speculative-model"),
                         (["--speculative-model", "x"], "only read with speculative-method draft"),
                         (["--speculative-method", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "--ngram-min"),
                         (["--speculative-method", "ngram", "--num-speculative-tokens", "0"],
                          "--num-speculative-tokens must be >= 1")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert needle in capsys.readouterr().err


def test_a_draft_with_another_vocabulary_is_refused(checkpoint, tmp_path):
    from services.model_worker.config.model import ConfigError

    make_checkpoint(tmp_path, vocab_size=256)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=64, block_size=4,
                                           speculative=SpeculativeConfig("draft", draft_model=str(tmp_path))))


def test_a_sequence_whose_single_draft_proposals_are_refused_rests_longer_each_time():
    from services.model_worker.engine.sequence import Sequence
    from services.model_worker.engine.speculator import MAX_REST_STEPS, Speculator

    # The draft proposer itself is not called here: proposing only reserves room for its tokens.
    speculator = Speculator(SpeculativeConfig("draft", draft_model="unused", num_speculative_tokens=4), object())
    seq = Sequence("r", [5, 6, 7] * 8, SamplingParams(temperature=0.0), 1000, frozenset())
    seq.num_cached_tokens = len(seq) - 1  # decoding

    def steps_until_a_proposal() -> int:
        for waited in range(MAX_REST_STEPS + 2):
            speculator.propose([seq])
            if seq.draft:
                return waited
        raise AssertionError("no proposal after the longest rest")

    assert steps_until_a_proposal() == 0
    speculator.record(seq, 4, 2)  # one of four taken: no rest, one more than taken next time
    assert seq.spec_k == 2 and steps_until_a_proposal() == 0
    speculator.record(seq, 2, 1)  # none of two taken: k falls to 1, still no rest
    assert seq.spec_k == 1 and steps_until_a_proposal() == 0
    rests = []
    for _ in range(8):  # a single proposal refused again and again
        speculator.record(seq, 1, 1)
        rests.append(steps_until_a_proposal())
    assert rests == [1, 2, 4, 8, 16, 32, 32, 32]
    speculator.record(seq, 1, 2)  # taken: the rests start over
    assert steps_until_a_proposal() == 0
    speculator.record(seq, 1, 1)
    assert steps_until_a_proposal() == 1


def test_prompt_lookup_never_rests():
    from services.model_worker.engine.sequence import Sequence
    from services.model_worker.engine.speculator import Speculator

    speculator = Speculator(SpeculativeConfig("ngram", num_speculative_tokens=4, ngram_min=1))
    seq = Sequence("r", [5, 6, 7] * 8, SamplingParams(temperature=0.0), 1000, frozenset())
    seq.num_cached_tokens = len(seq) - 1
    for _ in range(5):
        speculator.propose([seq])
        assert seq.draft  # the repeating prompt always has a continuation to propose
        speculator.record(seq, len(seq.draft), 1)
