"""The sampler's seeded draws: independent of the batch, resumable, exact in distribution (chi-square against
transformers' warpers, on fixed seeds: deterministic), and drawn without reading the device back."""
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
from services.model_worker.engine.sequence import Sequence
from services.model_worker.executor.sampler import Sampler
from tests.unit.test_sampler import BOTH_PATHS, NO_IDS, histories

TARGETS = [
    SamplingParams(temperature=1.5),
    SamplingParams(temperature=0.9, top_k=40),
    SamplingParams(temperature=1.2, top_p=0.9),
    SamplingParams(temperature=0.8, min_p=0.05, logprobs=3),
    SamplingParams(temperature=1.1, top_k=30, top_p=0.95, min_p=0.01, repetition_penalty=1.3,
                   frequency_penalty=0.5, presence_penalty=0.2, logit_bias=((3, 4.0), (8, -2.0))),
]


def random_others(count: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[SamplingParams], list]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(count, vocab, generator=gen) * 2
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
             SamplingParams(top_p=0.5, presence_penalty=1.0), SamplingParams(min_p=0.2, logprobs=1),
             SamplingParams(top_k=50, top_p=0.9, repetition_penalty=0.8)]
    params = [kinds[int(i)] for i in torch.randint(len(kinds), (count,), generator=gen)]
    draws = [None if i % 3 == 0 else (int(s), int(c)) for i, (s, c) in enumerate(zip(
        torch.randint(0, 2 ** 62, (count,), generator=gen), torch.randint(0, 100, (count,), generator=gen)))]
    return logits, params, draws


@BOTH_PATHS
@pytest.mark.parametrize("target", TARGETS, ids=["plain", "top_k", "top_p", "min_p", "everything"])
def test_a_row_draws_the_same_token_alone_and_anywhere_in_a_batch(target, batched):
    vocab = 500
    gen = torch.Generator().manual_seed(4)
    history = torch.randint(vocab, (12,), generator=gen)
    for counter in range(5):
        row = torch.randn(1, vocab, generator=gen) * 2
        key = (2 ** 64 - 17, counter)
        alone = Sampler(batched)(row, [target], histories(row, [target], [history], [history]), [key]).token_ids[0]
        for position in (0, 17, 63):
            logits, params, draws = random_others(64, vocab, seed=counter * 10 + position)
            logits[position], params[position], draws[position] = row[0], target, key
            ids = [history if p.has_penalties else NO_IDS for p in params]
            batch = Sampler(batched)(logits, params, histories(logits, params, ids, ids), draws).token_ids
            assert batch[position] == alone, (counter, position)


def test_the_cpu_and_gpu_groupings_draw_the_same_tokens():
    vocab, rows = 1000, 100
    logits, params, _ = random_others(rows, vocab, seed=9)
    logits = logits.bfloat16().float()  # ties, as bf16 logits have
    params = [SamplingParams(**{**p.__dict__, "top_k": k}) for p, k in zip(params, [-1, 3, 20, 999, 1000] * 20)]
    draws = [(s, 11) for s in range(rows)]
    ids = [[1, 2, 3]] * rows
    penalties = histories(logits, params, ids, ids)
    grouped = Sampler(batched=False)(logits, params, penalties, draws).token_ids
    assert grouped == Sampler(batched=True)(logits, params, penalties, draws).token_ids
    assert len(set(grouped)) > 30


def test_a_stream_resumes_where_it_stopped():
    """A sequence's tokens for counters 0..N are the same in one run as in two runs split anywhere, each with
    its own sampler and other rows around it: all it needs is its seed and the counter."""
    vocab, steps = 500, 16
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(steps, vocab, generator=gen) * 1.5
    target = SamplingParams(temperature=1.0, top_p=0.95)

    def run(sampler, first, last, crowd):
        tokens = []
        for counter in range(first, last):
            logits, params, draws = random_others(crowd, vocab, seed=counter)
            logits = torch.cat((logits, rows[counter:counter + 1]))
            out = sampler(logits, params + [target], None, draws + [(77, counter)])
            tokens.append(out.token_ids[-1])
        return tokens

    whole = run(Sampler(), 0, steps, 0)
    assert len(set(whole)) > 5
    for split in (1, 7, 15):
        assert run(Sampler(), 0, split, 3) + run(Sampler(batched=True), split, steps, 9) == whole


def reference_probs(logits: torch.Tensor, p: SamplingParams, history: torch.Tensor) -> torch.Tensor:
    """transformers' processors in generate()'s order (the bias added first by hand), as probabilities."""
    scores = logits.clone().unsqueeze(0)
    for token, bias in p.logit_bias:
        scores[0, token] += bias
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(history.unsqueeze(0), scores)
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        warpers.append(MinPLogitsWarper(p.min_p))
    for warper in warpers:
        scores = warper(history.unsqueeze(0), scores)
    return scores.softmax(-1).squeeze(0).double()


@BOTH_PATHS
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05, repetition_penalty=1.5, logit_bias=((7, 1.5),)),
], ids=["t1", "t0.6", "top_k", "top_p", "min_p", "everything"])
def test_draws_follow_the_distribution_exactly(params, batched):
    """Goodness of fit of 40,000 draws (one seed, successive counters) over a 10-token vocabulary."""
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.4, 0.0, -0.5, -1.0, -2.0, -3.0])
    history = torch.tensor([0, 2, 2])
    expected = reference_probs(logits, params, history)
    n = 40_000
    out = Sampler(batched)(logits.expand(n, -1), [params] * n, histories(logits.expand(n, -1), [params] * n,
                                                                          [history] * n, [NO_IDS] * n),
                           [(123, c) for c in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=10).double()
    support = expected > 0
    assert torch.equal(counts > 0, support)
    stat = float(((counts[support] - n * expected[support]) ** 2 / (n * expected[support])).sum())
    df = int(support.sum()) - 1
    assert float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))) > 1e-3


def test_successive_tokens_of_a_sequence_are_independent():
    """Tokens at counters c and c + 1 of 20,000 seeds: a contingency table with no dependence."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0])
    n = 20_000
    sampler = Sampler()

    def tokens(counter):
        return sampler(logits.expand(n, -1), [SamplingParams()] * n, None, [(s, counter) for s in range(n)]).token_ids

    cells = torch.tensor(tokens(4)) * 5 + torch.tensor(tokens(5))
    table = torch.bincount(cells, minlength=25).double().view(5, 5)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    assert float(torch.special.gammaincc(torch.tensor(8.0, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))) > 1e-3


def test_sample_never_reads_the_device(monkeypatch):
    """The path GPUs take (batched), run on the CPU with every device read raising: greedy, sampled, seeded,
    unseeded, top_k/top_p/min_p, penalties, logit bias and logprobs rows in one batch."""
    vocab = 400
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(8, vocab, generator=gen)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2),
              SamplingParams(), SamplingParams(top_k=5, seed=3), SamplingParams(top_p=0.9),
              SamplingParams(min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3, logprobs=4),
              SamplingParams(top_k=40, top_p=0.8, min_p=0.02, logit_bias=((5, 2.0),)), SamplingParams(temperature=0.3)]
    history = [torch.randint(vocab, (n,), generator=gen) for n in range(8)]
    draws = [(3, 0), (4, 1), None, (3, 2), (5, 3), None, (6, 4), (7, 5)]
    penalties = histories(logits, params, history, history)
    expected = Sampler(batched=True)(logits, params, penalties, draws[:2] + [(1, 1)] + draws[3:5] +
                                     [(2, 2)] + draws[6:])

    def read(*args, **kwargs):
        raise AssertionError("sample() read a tensor back")

    sampler = Sampler(batched=True)
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, read)
    for _ in range(2):  # building the columns, then reusing them
        sampled = sampler.sample(logits, params, penalties, draws[:2] + [(1, 1)] + draws[3:5] + [(2, 2)] +
                                 draws[6:])
    monkeypatch.undo()
    assert sampled.to_host() == expected


def test_the_columns_are_reused_while_the_same_rows_come_back():
    params = [SamplingParams(top_k=3), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5)]
    sampler = Sampler()
    first = sampler.columns(params, 50, torch.device("cpu"))
    assert sampler.columns(list(params), 50, torch.device("cpu")) is first  # a new list of the same rows
    for changed in (params[::-1], params[:2], params[:2] + [SamplingParams(top_p=0.5)]):
        assert sampler.columns(changed, 50, torch.device("cpu")) is not first
    # A batch that changes under the sampler draws what a fresh sampler draws.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    draws = [(i, 0) for i in range(3)]
    for batch in (params, params[::-1], params[1:], params):
        rows = len(batch)
        got = sampler(logits[:rows], batch, None, draws[:rows])
        assert got == Sampler()(logits[:rows], batch, None, draws[:rows])


def test_a_sequence_keys_its_draws_by_seed_and_output_index():
    seeded = Sequence("a", [1, 2], SamplingParams(seed=2 ** 64 - 1), 10, frozenset())
    assert seeded.draw_key() == (2 ** 64 - 1, 0)
    seeded.append(5)
    seeded.num_pending = 2  # tokens drawn by steps still in flight
    assert seeded.draw_key() == (2 ** 64 - 1, 3)
    unseeded = [Sequence(str(i), [1], SamplingParams(), 10, frozenset()) for i in range(3)]
    seeds = {s.draw_key()[0] for s in unseeded}
    assert len(seeds) == 3 and all(0 <= s < 2 ** 64 for s in seeds)
