"""The batched sampler against transformers' logits processors, hand-worked penalties, seeded draws.

Mask tests run both ways of grouping rows (truncation.py): the CPU's (grouped) and the GPU's (batched)."""

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor.penalty_state import PenaltyRows
from services.model_worker.executor.sampler import Sampler, apply_penalties
from services.model_worker.executor.sampling_columns import Columns
from services.model_worker.executor.truncation import masked_logits

NO_IDS = torch.empty(0, dtype=torch.long)
BOTH_PATHS = pytest.mark.parametrize("batched", [False, True], ids=["grouped", "batched"])


def histories(logits: torch.Tensor, params: list[SamplingParams], prompts: list, outputs: list) -> PenaltyRows | None:
    return PenaltyRows.from_ids(params, prompts, outputs, logits.shape[1], logits.device)


def apply_sampling_masks(logits: torch.Tensor, params: list[SamplingParams], batched: bool = False) -> torch.Tensor:
    """Temperature-scaled logits with -inf outside the tokens a row can emit; greedy rows keep only
    their argmax: the sampler's own masking (truncation.py), laid out over the whole vocabulary."""
    logits = logits.float()
    out = torch.full_like(logits, float("-inf"))
    for i, p in enumerate(params):
        if p.is_greedy:
            best = logits[i].argmax()
            out[i, best] = logits[i, best]
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled_rows:
        columns = Columns([params[i] for i in sampled_rows], logits.shape[1], logits.device)
        out[sampled_rows] = masked_logits(logits[sampled_rows] / columns.temperature, columns, batched)
    return out


def support(masked_row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked_row).nonzero().flatten().tolist())


def reference_masked(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in the order generate() chains them, on one (V,) row."""
    scores = row.float().unsqueeze(0)
    unused_ids = torch.zeros(1, 1, dtype=torch.long)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warper in warpers:
        scores = warper(unused_ids, scores)
    return scores.squeeze(0)


def sample_many(logits_row: torch.Tensor, p: SamplingParams, n: int, seed: int, batched: bool = False) -> list[int]:
    """n independent draws for one row: n copies of it, one seed at n successive counters."""
    batch = logits_row.unsqueeze(0).expand(n, -1)
    draws = [(seed, i) for i in range(n)]
    out = Sampler(batched=batched)(batch, [p] * n, None, draws)
    return out.token_ids


def probs_of(values: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(values, dtype=torch.float32))


# --- masks on crafted logits -------------------------------------------------------------------


@BOTH_PATHS
def test_top_k_keeps_exactly_k_without_ties(batched):
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    masked = apply_sampling_masks(logits, [SamplingParams(top_k=3)], batched)
    assert support(masked[0]) == {1, 2, 3}


@BOTH_PATHS
def test_top_k_keeps_every_token_tied_with_the_kth(batched):
    logits = torch.tensor([[3.0, 2.0, 1.0, 2.0, 2.0, 0.5]])
    p = SamplingParams(top_k=2)
    masked = apply_sampling_masks(logits, [p], batched)
    assert support(masked[0]) == {0, 1, 3, 4}
    assert support(masked[0]) == support(reference_masked(logits[0], p))


@pytest.mark.parametrize("top_k", [-1, 0, 6, 100])
def test_top_k_off_or_at_least_vocab_keeps_everything(top_k):
    logits = torch.tensor([[3.0, 2.0, 1.0, 2.0, 2.0, -9.0]])
    masked = apply_sampling_masks(logits, [SamplingParams(top_k=top_k)])
    assert support(masked[0]) == set(range(6))


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.5, {0}),  # the top token alone reaches 0.5 exactly
        (0.5001, {0, 1}),
        (0.75, {0, 1}),  # cumulative 0.5 + 0.25 hits 0.75 exactly: no more tokens
        (0.7501, {0, 1, 2}),  # tokens 2 and 3 tie; the lower id ranks first
        (1.0, {0, 1, 2, 3}),
        (0.01, {0}),
        (1e-9, {0}),  # 1 - top_p rounds to 1.0 in float32; the top token is still kept
    ],
)
@BOTH_PATHS
def test_top_p_cuts_at_the_smallest_set_reaching_top_p(top_p, expected, batched):
    logits = probs_of([0.5, 0.25, 0.125, 0.125]).unsqueeze(0)
    # The boundary cases need these probabilities to be exact in float32.
    assert logits.softmax(-1).tolist() == [[0.5, 0.25, 0.125, 0.125]]
    p = SamplingParams(top_p=top_p)
    assert support(apply_sampling_masks(logits, [p], batched)[0]) == expected
    if len(expected) != 3:  # transformers breaks the 2-vs-3 tie its own way
        assert support(reference_masked(logits[0], p)) == expected


def test_top_p_ranks_the_lower_id_first_among_ties_whatever_their_position():
    logits = probs_of([0.125, 0.25, 0.125, 0.5]).unsqueeze(0)
    masked = apply_sampling_masks(logits, [SamplingParams(top_p=0.8)])
    assert support(masked[0]) == {0, 1, 3}


@BOTH_PATHS
def test_top_p_tie_rule_holds_inside_a_top_k_set(batched):
    # top_k=5 keeps {4, 0, 1, 2, 3} (nothing ties the 5th), renormalized 3:1:1:1:1 over 7; the cut
    # falls among the four tied tokens, and the lowest ids are kept (topk alone orders ties freely).
    logits = probs_of([0.1, 0.1, 0.1, 0.1, 0.3, 0.01, 0.02, 0.01, 0.03, 0.01]).unsqueeze(0)
    for top_p, expected in ((0.5, {4, 0}), (0.65, {4, 0, 1}), (0.8, {4, 0, 1, 2})):
        masked = apply_sampling_masks(logits, [SamplingParams(top_k=5, top_p=top_p)], batched)
        assert support(masked[0]) == expected


def test_top_p_applies_to_the_distribution_left_by_top_k():
    logits = probs_of([0.4, 0.3, 0.2, 0.1]).unsqueeze(0)
    # After top_k=2 the probabilities are 4/7 and 3/7: top_p=0.55 keeps only the first.
    p = SamplingParams(top_k=2, top_p=0.55)
    assert support(apply_sampling_masks(logits, [p])[0]) == {0}
    assert support(reference_masked(logits[0], p)) == {0}
    # Without top_k, 0.4 < 0.55 so two tokens are needed.
    assert support(apply_sampling_masks(logits, [SamplingParams(top_p=0.55)])[0]) == {0, 1}


@pytest.mark.parametrize(
    ("temperature", "min_p", "expected"),
    [
        (1.0, 0.3, {0, 1}),  # probabilities 8:4:2:1, threshold 2.4
        (1.0, 0.2, {0, 1, 2}),  # threshold 1.6
        (0.5, 0.2, {0, 1}),  # after temperature 64:16:4:1, threshold 12.8
        (2.0, 0.4, {0, 1, 2}),  # after temperature ~2.83:2:1.41:1, threshold 1.13
        (1.0, 1.0, {0}),
        (1.0, 0.0, {0, 1, 2, 3}),
    ],
)
def test_min_p_is_relative_to_the_top_probability_after_temperature(temperature, min_p, expected):
    logits = probs_of([8.0, 4.0, 2.0, 1.0]).unsqueeze(0)
    p = SamplingParams(temperature=temperature, min_p=min_p)
    assert support(apply_sampling_masks(logits, [p])[0]) == expected
    assert support(reference_masked(logits[0], p)) == expected


def test_masked_values_are_the_temperature_scaled_logits():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    p = SamplingParams(temperature=0.5, top_k=3)
    masked = apply_sampling_masks(logits, [p])[0]
    torch.testing.assert_close(masked[[0, 1, 3]], torch.tensor([4.0, 2.0, 1.0]))
    assert masked[2] == float("-inf")


def test_greedy_rows_keep_only_the_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert support(apply_sampling_masks(logits, [SamplingParams(temperature=0.0)])[0]) == {1}


def _random_params(gen: torch.Generator, vocab: int) -> SamplingParams:
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    return SamplingParams(
        temperature=pick([0.3, 0.7, 1.0, 1.6]),
        top_k=pick([-1, 0, 1, 3, 10, vocab - 1, vocab, vocab + 5]),
        top_p=pick([1.0, 0.95, 0.8, 0.5, 0.2]),
        min_p=pick([0.0, 0.0, 0.05, 0.2, 0.6]),
    )


@BOTH_PATHS
@pytest.mark.parametrize("quantized", [False, True])
def test_support_matches_transformers_warpers_on_random_rows(quantized, batched):
    # One batched call over rows with mixed settings, each row checked against the reference alone.
    # Quantized logits (bf16-like ties) are checked where tie order cannot matter: no top_p.
    gen = torch.Generator().manual_seed(1234)
    vocab, rows = 64, 300
    logits = torch.randn(rows, vocab, generator=gen) * 3
    params = [_random_params(gen, vocab) for _ in range(rows)]
    if quantized:
        logits = (logits * 2).round() / 2
        params = [
            SamplingParams(temperature=p.temperature, top_k=p.top_k, min_p=p.min_p) for p in params
        ]
    masked = apply_sampling_masks(logits, params, batched)
    kept_sizes = set()
    for i, p in enumerate(params):
        reference = reference_masked(logits[i], p)
        assert support(masked[i]) == support(reference), (i, p)
        finite = torch.isfinite(reference)
        torch.testing.assert_close(masked[i][finite], reference[finite])
        kept_sizes.add(len(support(reference)))
    assert len(kept_sizes) > 10  # the sweep exercised many different cuts


@BOTH_PATHS
def test_draws_stay_inside_the_support_and_cover_it(batched):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 40, generator=gen) * 2
    p = SamplingParams(temperature=1.3, top_k=12, top_p=0.9, min_p=0.05)
    allowed = support(apply_sampling_masks(logits, [p], batched)[0])
    assert 2 < len(allowed) < 12
    drawn = set(sample_many(logits[0], p, 3000, seed=1, batched=batched))
    assert drawn == allowed


# --- penalties ---------------------------------------------------------------------------------


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    prompt = [torch.tensor([0, 1, 1])]
    output = [torch.tensor([1, 2, 2])]
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)
    got = apply_penalties(logits, [p], histories(logits, [p], prompt, output))
    # repetition over {0, 1, 2} (prompt + output, once each): 2 -> 1, -1 -> -2, 0.5 -> 0.25;
    # then output counts {1: 1, 2: 2}: token 1 -= 0.5 + 0.3, token 2 -= 1.0 + 0.3.
    expected = torch.tensor([[1.0, -2.8, -1.05, -3.0, 1.0]])
    torch.testing.assert_close(got, expected)
    assert logits.tolist() == [[2.0, -1.0, 0.5, -3.0, 1.0]]  # the input is left alone


def test_presence_and_frequency_ignore_the_prompt():
    logits = torch.zeros(1, 4)
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    got = apply_penalties(logits, [p], histories(logits, [p], [[0, 0, 3]], [[3]]))
    assert got.tolist() == [[0.0, 0.0, 0.0, -2.0]]


def test_negative_presence_and_frequency_encourage_repeats():
    p = SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0)
    got = apply_penalties(torch.zeros(1, 3), [p], histories(torch.zeros(1, 3), [p], [[]], [[2, 2]]))
    assert got.tolist() == [[0.0, 0.0, 2.0]]


def test_repetition_penalty_matches_transformers_per_row():
    gen = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(3, vocab, generator=gen) * 4
    prompts = [torch.randint(vocab, (n,), generator=gen) for n in (7, 0, 20)]
    outputs = [torch.randint(vocab, (n,), generator=gen) for n in (3, 5, 0)]
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 1.0)]
    got = apply_penalties(logits, params, histories(logits, params, prompts, outputs))
    for i, p in enumerate(params):
        ids = torch.cat((prompts[i], outputs[i])).unsqueeze(0)
        processor = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)
        reference = processor(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], reference)
    assert torch.equal(got[2], logits[2])


MIXED = [dict(repetition_penalty=1.3), dict(presence_penalty=-0.7, frequency_penalty=0.45),
         dict(repetition_penalty=0.8, presence_penalty=0.3, frequency_penalty=-1.1), dict(frequency_penalty=2.0),
         dict(presence_penalty=1.5), dict(repetition_penalty=1.05, frequency_penalty=0.1)]


@pytest.mark.parametrize("every_row", [True, False], ids=["every_row", "some_rows"])
@pytest.mark.parametrize("kinds", [
    MIXED,
    [{k: v for k, v in kind.items() if k != "frequency_penalty"} or dict(presence_penalty=0.2) for kind in MIXED],
    [{k: v for k, v in kind.items() if k != "presence_penalty"} or dict(frequency_penalty=-0.2) for kind in MIXED],
], ids=["mixed", "presence_only", "frequency_only"])
def test_penalties_equal_the_plain_formula_bit_for_bit(every_row, kinds):
    """Rows gathered by slot from a larger table, in place arithmetic: the same floats as the formula written
    out per row, masked (-inf) and signed-zero logits included."""
    gen = torch.Generator().manual_seed(17)
    vocab, batch = 300, 6
    logits = torch.randn(batch, vocab, generator=gen) * 3
    logits[:, :5] = torch.tensor([float("-inf"), 0.0, -0.0, 1e-30, -1e-30])
    params = [SamplingParams(**kind) for kind in kinds]
    if not every_row:
        params[1] = params[4] = SamplingParams(logit_bias=((7, 2.0),))
    prompts = [torch.randint(vocab, (int(n),), generator=gen).tolist() for n in torch.randint(0, 40, (batch,))]
    outputs = [torch.randint(8, (int(n),), generator=gen).tolist() + [1, 2] for n in torch.randint(0, 60, (batch,))]
    table = PenaltyRows.from_ids(params, prompts, outputs, vocab, logits.device)
    # The same rows scattered into a larger table at other slots, as the engine's state holds them.
    slots = torch.tensor([5, 0, 9, 2, 7, 3])[:table.slots.numel()]
    wide = PenaltyRows(table.rows, slots, torch.zeros(10, vocab, dtype=torch.bool).index_copy(0, slots, table.seen),
                       torch.zeros(10, vocab).index_copy(0, slots, table.counts))
    got = apply_penalties(logits, params, wide)
    expected = logits.clone()
    for i, p in enumerate(params):
        x = expected[i]
        for t, b in p.logit_bias:
            x[t] += b
        if not p.has_penalties:
            continue
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[prompts[i] + outputs[i]] = True
        counts = torch.bincount(torch.tensor(outputs[i]), minlength=vocab).float()
        if p.repetition_penalty != 1.0:
            x = torch.where(seen, torch.where(x < 0, x * p.repetition_penalty, x / p.repetition_penalty), x)
        if p.presence_penalty or p.frequency_penalty:
            x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        expected[i] = x
    assert torch.equal(got, expected)
    assert torch.equal(got.signbit(), expected.signbit())


def test_penalties_steer_greedy_and_leave_other_rows_alone():
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0.0)]
    outputs = [torch.tensor([0]), torch.tensor([0])]
    out = Sampler()(logits, params, histories(logits, params, [[], []], outputs), [None, None])
    assert out.token_ids == [1, 0]


# --- greedy, temperature, seeds ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_in_any_dtype(dtype):
    gen = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, 1000, generator=gen) * 5).to(dtype)
    params = [SamplingParams(temperature=0.0)] * 6
    out = Sampler()(logits, params, None, [None] * 6)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 6 and out.top_logprobs == [[]] * 6


def test_greedy_rows_in_a_sampled_batch_are_argmax():
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(4, 300, generator=gen) * 5
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5),
        SamplingParams(temperature=1e-6),
        SamplingParams(top_p=0.5),
    ]
    out = Sampler()(logits, params, None, [(i, 0) for i in range(4)])
    argmax = logits.argmax(-1).tolist()
    assert out.token_ids[0] == argmax[0] and out.token_ids[2] == argmax[2]


@pytest.mark.parametrize("temperature", [0.6, 2.5])
def test_empirical_distribution_follows_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, 0.3, 0.0, -1.0])
    n, tolerance = 20_000, 0.015  # about 4 standard errors at p = 0.5
    expected = (logits / temperature).softmax(-1)
    untempered = logits.softmax(-1)
    assert (expected - untempered).abs().max() > 3 * tolerance  # the test can tell T from 1
    p = SamplingParams(temperature=temperature)
    out = Sampler()(logits.expand(n, -1), [p] * n, None, [(0, i) for i in range(n)])
    tokens = out.token_ids
    frequencies = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    assert (frequencies - expected).abs().max() < tolerance


def _run_steps(logits_steps, params, seeds, target_row):
    """Runs several decode steps for a batch; returns target_row's tokens."""
    batch = len(params)
    outputs = [NO_IDS] * batch
    prompts = [torch.tensor([1, 2, 3])] * batch
    tokens = []
    sampler = Sampler()
    for step, logits in enumerate(logits_steps):
        draws = [(s, step) if s is not None else None for s in seeds]
        out = sampler(logits[:batch], params, histories(logits[:batch], params, prompts, outputs), draws)
        outputs = [torch.cat((o, torch.tensor([t]))) for o, t in zip(outputs, out.token_ids)]
        tokens.append(out.token_ids[target_row])
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.9, top_k=40, top_p=0.95),  # top_k path
        SamplingParams(temperature=1.2, top_p=0.97, min_p=0.01),  # full-sort path
        SamplingParams(temperature=1.5),  # no truncation
        SamplingParams(temperature=1.1, top_k=30, repetition_penalty=1.2, frequency_penalty=0.4),
    ],
)
def test_a_seed_gives_the_same_tokens_alone_and_in_any_batch(target):
    gen = torch.Generator().manual_seed(5)
    vocab, steps = 500, 12
    base = torch.randn(steps, 1, vocab, generator=gen) * 1.5
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.8, presence_penalty=1.0),
        SamplingParams(top_k=5, min_p=0.1),
    ]
    other_logits = torch.randn(steps, 4, vocab, generator=gen)
    alone = _run_steps(base, [target], [42], 0)

    first = torch.cat((base, other_logits), dim=1)
    in_front = _run_steps(first, [target] + others, [42, 1, 2, None, 3], 0)
    middle = torch.cat((other_logits[:, :2], base, other_logits[:, 2:]), dim=1)
    in_middle = _run_steps(middle, others[:2] + [target] + others[2:], [7, None, 42, 8, 9], 2)
    pair = torch.cat((other_logits[:, :1], base), dim=1)
    in_pair = _run_steps(pair, [others[1], target], [42, 42], 1)  # a neighbour on the same seed
    assert alone == in_front == in_middle == in_pair

    different = {tuple(_run_steps(base, [target], [seed], 0)) for seed in range(5)}
    assert len(different) == 5


# --- logprobs ----------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits():
    gen = torch.Generator().manual_seed(21)
    logits = (torch.randn(4, 200, generator=gen) * 3).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.5, top_k=10, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=20),
    ]
    outputs = [torch.tensor([int(logits[i].float().argmax())] * 5) for i in range(4)]
    out = Sampler()(logits, params, histories(logits, params, [[]] * 4, outputs), [(i, 0) for i in range(4)])
    reference = logits.float().log_softmax(-1)

    for i in (0, 1, 3):
        assert out.logprobs[i] == pytest.approx(reference[i, out.token_ids[i]].item(), abs=1e-6)
    assert out.token_ids[3] != outputs[3][0].item()  # the penalty moved the choice, not the logprob
    assert out.logprobs[2] is None and out.top_logprobs[2] == []
    assert out.top_logprobs[1] == []
    for i, n in ((0, 5), (3, 20)):
        ids = [t for t, _ in out.top_logprobs[i]]
        values = [v for _, v in out.top_logprobs[i]]
        assert len(ids) == n
        assert values == sorted(values, reverse=True)
        assert ids == reference[i].topk(n).indices.tolist()
        assert values == pytest.approx(reference[i].topk(n).values.tolist(), abs=1e-6)
        assert all(math.isfinite(v) for v in values)


def test_sampler_leaves_float32_logits_untouched():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    before = logits.clone()
    p = SamplingParams(temperature=0.5, top_k=2, repetition_penalty=2.0, presence_penalty=1.0)
    Sampler()(logits, [p], histories(logits, [p], [[0]], [[1]]), [(0, 0)])
    assert torch.equal(logits, before)


@pytest.mark.cuda
def test_cuda_rows_match_cpu_masks_and_are_reproducible_in_a_batch():
    gen = torch.Generator().manual_seed(31)
    vocab = 4096
    logits = torch.randn(3, vocab, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, logprobs=3),
        SamplingParams(temperature=1.1, top_p=0.8, min_p=0.02, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
    ]
    on_cpu = apply_sampling_masks(logits, params)
    on_cuda = apply_sampling_masks(logits.cuda(), params).cpu()
    for i in range(3):
        assert support(on_cuda[i]) == support(on_cpu[i])

    def run(rows):
        cuda_logits = logits[rows].cuda().to(torch.bfloat16)
        ids = [torch.tensor([1, 2, 3], device="cuda")] * len(rows)
        chosen = [params[r] for r in rows]
        return Sampler()(cuda_logits, chosen, histories(cuda_logits, chosen, ids, ids),
                         [(100 + r, 5) for r in rows]).token_ids

    batched = run([0, 1, 2])
    assert [run([r])[0] for r in range(3)] == batched
