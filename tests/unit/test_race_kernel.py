"""The sampler's one-pass race (random_draws.c's race_rows) and its draw words (words_rows): against a float64
reference of the race written from its definition, against the torch path on the rows where float32 arithmetic
decides (NaN, infinities, everything masked), and the words against the Python path."""
import numpy as np
import pytest
import torch

from services.model_worker.executor import random_draws
from services.model_worker.kernels import cpu_random_draws
from tests.unit.test_random_draws import uniform_np

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_random_draws.load() is not None, "the kernel must build here (gcc is part of the test machine)"


def reference(x: torch.Tensor, words: torch.Tensor, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the winning column of p_t / E_t in float64 and how far ahead of the runner-up it is (relative)."""
    u = uniform_np(words.numpy(), np.broadcast_to(ids.numpy(), x.shape))
    weights = np.exp(x.double().numpy() - x.double().numpy().max(axis=1, keepdims=True)) / -np.log(u)
    order = np.sort(np.pad(weights, ((0, 0), (1, 0))), axis=1)  # a zero runner-up for a row of one
    return weights.argmax(axis=1), (order[:, -1] - order[:, -2]) / order[:, -1]


def torch_path(monkeypatch, *args) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(cpu_random_draws, "race", lambda *a: None)
        return random_draws.race(*args)


def random_rows(rows: int, width: int, seed: int, masked: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * 3
    x[torch.rand(rows, width, generator=gen) < masked] = float("-inf")
    words = random_draws.draw_words([(seed * 1000 + r, r % 7) for r in range(rows)], random_draws.SAMPLE, CPU)
    return x, words


@pytest.mark.parametrize("width", [1, 37, 512, 10_000])
def test_the_race_picks_the_largest_weight_of_the_exact_arithmetic(width):
    x, words = random_rows(300, width, seed=width, masked=0.3)
    x[:, 0] = 0.0  # every row keeps a candidate
    chosen = random_draws.race(x, words, None)
    want, lead = reference(x, words, torch.arange(width))
    decided = lead > 1e-5  # float32 cannot tell closer pairs apart
    assert decided.mean() > 0.99
    assert np.array_equal(chosen.numpy()[decided], want[decided])
    assert torch.isfinite(x.gather(1, chosen.unsqueeze(1))).all(), "a masked token won"


def test_temperature_bf16_and_token_ids_are_read_as_the_torch_path_reads_them():
    x, words = random_rows(200, 700, seed=3)
    ids = torch.stack([torch.randperm(151_936, generator=torch.Generator().manual_seed(r))[:700] for r in range(200)])
    temperature = torch.linspace(0.2, 2.0, 200).unsqueeze(1)
    logits = x.bfloat16()
    chosen = random_draws.race(logits, words, ids, temperature)
    want, lead = reference(logits.float() / temperature, words, ids)
    decided = lead > 1e-5
    assert decided.mean() > 0.99 and np.array_equal(chosen.numpy()[decided], want[decided])
    # A shared row of ids is the same as every row holding it.
    shared = random_draws.race(x, words, ids[0])
    assert torch.equal(shared, random_draws.race(x, words, ids[0].expand(200, -1)))


def test_a_row_answers_the_same_alone_at_any_width_and_in_any_batch():
    x, words = random_rows(64, 5000, seed=11, masked=0.5)
    x[:, 17] = 1.0
    full = random_draws.race(x, words, None)
    for r in (0, 31, 63):
        assert random_draws.race(x[r:r + 1], words[r:r + 1], None)[0] == full[r]
        # The same candidates laid out in another order, masked tokens left out: the same token wins.
        kept = torch.isfinite(x[r]).nonzero().squeeze(1)
        order = kept[torch.randperm(len(kept), generator=torch.Generator().manual_seed(r))]
        column = random_draws.race(x[r:r + 1, order], words[r:r + 1], order)[0]
        assert order[column] == full[r]


@pytest.mark.parametrize("case", ["nan", "inf", "all masked", "one candidate in the last block"])
def test_rows_float32_arithmetic_decides_answer_as_the_torch_path(monkeypatch, case):
    width = 9000  # three of the kernel's column blocks
    x, words = random_rows(4, width, seed=5)
    if case == "nan":
        x[0, 5000], x[1, 3], x[1, 8000] = float("nan"), float("nan"), float("nan")
    elif case == "inf":
        x[0, 6000], x[1, 2], x[1, 4500] = float("inf"), float("inf"), float("inf")
    elif case == "all masked":
        x[:2] = float("-inf")
    else:  # every other weight below the kernel's floor: 0, as exp underflows in torch
        x[:2] = -1e6
        x[:2, 8999] = 0.0
    got = random_draws.race(x, words, None)
    assert torch.equal(got, torch_path(monkeypatch, x, words, None))
    if case == "inf":
        assert got[:2].tolist() == [6000, 2]
    elif case == "one candidate in the last block":
        assert got[:2].tolist() == [8999, 8999]


def test_draw_words_match_the_python_path():
    draws = [(0, 0), (2 ** 64 - 1, 2 ** 40), (2 ** 63, 5), (12345, 2 ** 31), (7, 2 ** 62 + 3)]
    for stream in range(random_draws.NUM_STREAMS):
        assert torch.equal(random_draws.draw_words(draws, stream, CPU), random_draws._words_reference(draws, stream))
    # Out of the kernel's range: the Python path, which takes a seed mod 2**64.
    assert cpu_random_draws.words((-1,), (0,), 0, random_draws.NUM_STREAMS) is None
    assert cpu_random_draws.words((1,), (-3,), 0, random_draws.NUM_STREAMS) is None
    assert torch.equal(random_draws.draw_words([(-1, 2)], 0, CPU), random_draws.draw_words([(2 ** 64 - 1, 2)], 0, CPU))
