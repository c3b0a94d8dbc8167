"""The counter-based draws: against a numpy uint32 reference of the hash, the C kernel against the torch path,
and the values' distribution and independence (chi-square on fixed seeds: deterministic)."""
import os

import numpy as np
import pytest
import torch

from services.model_worker.executor import random_draws
from services.model_worker.kernels import cpu_random_draws, triton_random_draws

CPU = torch.device("cpu")


def lowbias32_np(x: np.ndarray) -> np.ndarray:
    """Wellons' lowbias32 in numpy's uint32 arithmetic, which wraps."""
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def uniform_np(words: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The module docstring's definition, written again: (R, 3) words, (R, W) ids."""
    w = words[:, 2:].astype(np.uint32)
    k0 = lowbias32_np(words[:, :1].astype(np.uint32) ^ w)
    k1 = lowbias32_np(words[:, 1:2].astype(np.uint32) ^ w)
    h = lowbias32_np(lowbias32_np(ids.astype(np.uint32) ^ k0) ^ k1)
    return ((h >> np.uint32(8)) | np.uint32(1)).astype(np.float64) / 2 ** 24


def chi_square_p(stat: float, df: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_random_draws.load() is not None, "the kernel must build here (gcc is part of the test machine)"


def test_seed_words_are_splitmix64s_first_output():
    # java.util.SplittableRandom(0).nextLong() == -2152535657050944081 == 0xE220A8397B1DCDAF
    assert random_draws.seed_words(0) == (0x7B1DCDAF, 0xE220A839)


def test_lowbias32_in_int64_matches_uint32_arithmetic_with_no_overflow():
    x = torch.cat((torch.randint(0, 2 ** 32, (10_000,), generator=torch.Generator().manual_seed(0)),
                   torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1])))
    got = random_draws.lowbias32_(x.clone(), torch.empty_like(x))
    assert np.array_equal(got.numpy().astype(np.uint32), lowbias32_np(x.numpy()))


@pytest.mark.parametrize("shared_ids", [True, False])
def test_both_paths_give_the_reference_uniforms(shared_ids):
    gen = torch.Generator().manual_seed(1)
    draws = [(0, 0), (2 ** 64 - 1, 2 ** 30), (12345, 7), (2 ** 63, 1)] + [(int(s), int(c)) for s, c in zip(
        torch.randint(0, 2 ** 62, (60,), generator=gen), torch.randint(0, 10 ** 6, (60,), generator=gen))]
    words = random_draws.draw_words(draws, random_draws.RESIDUAL, CPU)
    width = 5000
    ids = (torch.arange(width).unsqueeze(0) if shared_ids
           else torch.randint(0, 2 ** 31 - 1, (len(draws), 2 * width), generator=gen)[:, ::2])  # strided rows
    expected = uniform_np(words.numpy(), np.broadcast_to(ids.numpy(), (len(draws), width)))
    kernel = random_draws.uniform(words, ids)
    torch_path = random_draws.uniform_reference(words, ids)
    assert torch.equal(kernel, torch_path)
    assert np.array_equal(kernel.double().numpy(), expected)
    assert 0 < float(kernel.min()) and float(kernel.max()) < 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_random_draws.available(),
                    reason="runs in Triton's interpreter (tests/conftest.py sets it when triton is there)")
def test_the_triton_kernel_gives_the_reference_uniforms():
    draws = [(0, 0), (2 ** 64 - 1, 2 ** 30), (12345, 7)] + [(s * 7919, s) for s in range(9)]
    words = random_draws.draw_words(draws, random_draws.ACCEPT, CPU)
    strided = torch.randint(0, 2 ** 31 - 1, (len(draws), 1400), generator=torch.Generator().manual_seed(3))[:, ::2]
    for ids in (torch.arange(2500).unsqueeze(0), strided):
        uniforms = triton_random_draws.draw(words, ids, exponential=False)
        assert torch.equal(uniforms, random_draws.uniform_reference(words, ids))
        variates = triton_random_draws.draw(words, ids, exponential=True).double()
        exact = -uniforms.double().log()
        assert float(((variates - exact).abs() / exact).max()) < 2 ** -21


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_gpu_draws_the_cpus_uniforms():
    draws = [(s * 7919, s) for s in range(64)]
    ids = torch.arange(151_936)
    on_cpu = random_draws.uniform(random_draws.draw_words(draws, random_draws.SAMPLE, CPU), ids)
    cuda = torch.device("cuda")
    words = random_draws.draw_words(draws, random_draws.SAMPLE, cuda)
    assert random_draws._triton_agrees(cuda) == triton_random_draws.available()
    assert torch.equal(random_draws.uniform(words, ids.to(cuda)).cpu(), on_cpu)  # the kernel, where it runs
    assert torch.equal(random_draws.uniform_reference(words, ids.to(cuda).unsqueeze(0)).cpu(), on_cpu)
    variates = random_draws.exponential(words, ids.to(cuda)).cpu().double()
    assert float(((variates + on_cpu.double().log()).abs() / -on_cpu.double().log()).max()) < 2 ** -21


def test_exponential_is_minus_log_of_the_uniform_to_within_an_ulp():
    words = random_draws.draw_words([(s, s) for s in range(32)], random_draws.SAMPLE, CPU)
    ids = torch.arange(20_000)
    e = random_draws.exponential(words, ids).double()
    exact = -random_draws.uniform(words, ids).double().log()
    assert float(((e - exact).abs() / exact).max()) < 2 ** -23  # under one float32 ulp, even near 0
    torch_path = -random_draws.uniform_reference(words, ids.unsqueeze(0)).log().double()
    assert float(((e - torch_path).abs() / exact).max()) < 2 ** -22


def test_a_value_does_not_depend_on_where_it_is_computed():
    """The same (seed, counter, stream, token) alone, in any row of any batch, at any column."""
    words = random_draws.draw_words([(9, 3), (5, 1), (9, 3)], random_draws.DRAFT, CPU)
    ids = torch.arange(151_936)
    full = random_draws.exponential(words, ids)
    assert torch.equal(full[0], full[2])
    picked = torch.tensor([0, 1, 15, 16, 17, 4095, 4096, 151_935])
    alone = torch.stack([random_draws.exponential(words[:1], ids[i:i + 1])[0, 0] for i in picked])
    assert torch.equal(alone, full[0, picked])
    shuffled = torch.randperm(151_936, generator=torch.Generator().manual_seed(2))[:1000]
    assert torch.equal(random_draws.exponential(words, shuffled), full[:, shuffled])


def test_uniforms_are_uniform():
    words = random_draws.draw_words([(7, c) for c in range(2000)], random_draws.SAMPLE, CPU)
    u = random_draws.uniform(words, torch.arange(100)).flatten()
    counts = torch.bincount((u * 100).long(), minlength=100).double()
    expected = u.numel() / 100
    assert chi_square_p(float(((counts - expected) ** 2 / expected).sum()), 99) > 1e-3
    e = random_draws.exponential(words, torch.arange(100)).double()
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.02


def independence_p(a: torch.Tensor, b: torch.Tensor, bins: int = 10) -> float:
    """Chi-square test that two equally long samples of uniforms are independent (a bins x bins table)."""
    cells = (a * bins).long() * bins + (b * bins).long()
    table = torch.bincount(cells, minlength=bins * bins).double().view(bins, bins)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return chi_square_p(float(((table - expected) ** 2 / expected).sum()), (bins - 1) ** 2)


@pytest.mark.parametrize("neighbour", ["counter", "seed", "stream", "token"])
def test_neighbouring_draws_are_independent(neighbour):
    n, width = 4000, 16
    seeds, counters = list(range(1000, 1000 + n)), [3 * s % 977 for s in range(n)]
    ids = torch.arange(width)
    base = random_draws.uniform(random_draws.draw_words(list(zip(seeds, counters)), random_draws.SAMPLE, CPU), ids)
    if neighbour == "token":
        a, b = base[:, :-1].flatten(), base[:, 1:].flatten()
    else:
        draws = {"counter": list(zip(seeds, [c + 1 for c in counters])),
                 "seed": list(zip([s + 1 for s in seeds], counters)),
                 "stream": list(zip(seeds, counters))}[neighbour]
        stream = random_draws.DRAFT if neighbour == "stream" else random_draws.SAMPLE
        a, b = base.flatten(), random_draws.uniform(random_draws.draw_words(draws, stream, CPU), ids).flatten()
    assert not torch.equal(a, b)
    assert independence_p(a, b) > 1e-3


def test_a_missing_key_is_a_fresh_random_draw():
    first = random_draws.draw_words([None, None], random_draws.SAMPLE, CPU)
    second = random_draws.draw_words([None], random_draws.SAMPLE, CPU)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], second[0])
