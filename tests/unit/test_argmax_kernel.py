"""The argmax C kernel against torch.argmax: first index of the largest value, NaN largest, any row length."""
import pytest
import torch

from services.model_worker.kernels import cpu_argmax


@pytest.fixture(scope="module", autouse=True)
def library():
    assert cpu_argmax.load() is not None, "the kernel must build here (gcc is part of the test machine)"


def cases(dtype):
    gen = torch.Generator().manual_seed(0)
    random = [torch.randn(rows, n, generator=gen).to(dtype) for rows, n in ((1, 151936), (16, 1000), (3, 37), (2, 15))]
    ties = torch.zeros(4, 100, dtype=dtype)
    ties[0, [7, 40, 99]] = 3.0                      # equal maxima: the first
    ties[1, [0, 64]] = 2.0                          # one in the vectorised part, one in the tail
    ties[2] = float("-inf")                         # nothing but -inf: index 0
    ties[3, 50:] = -0.0                             # -0.0 and 0.0 are equal: the first zero
    nans = torch.randn(3, 70, generator=gen).to(dtype)
    nans[0, [20, 30]] = float("nan")                # NaN counts as largest: the first NaN
    nans[1, 69] = float("nan")                      # in the tail
    nans[2, 5] = float("inf")
    strided = torch.randn(5, 96, generator=gen).to(dtype)[:, 10:90]  # rows 96 apart
    return [*random, ties, nans, strided]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_torch_argmax(dtype):
    for logits in cases(dtype):
        out = cpu_argmax.argmax(logits)
        assert out.dtype == torch.int64
        assert torch.equal(out, logits.argmax(dim=-1)), logits


def test_other_dtypes_and_layouts_use_torch():
    half = torch.randn(4, 50).half()
    assert torch.equal(cpu_argmax.argmax(half), half.argmax(dim=-1))
    columns = torch.randn(50, 4).t()  # not contiguous along the vocabulary
    assert torch.equal(cpu_argmax.argmax(columns), columns.argmax(dim=-1))
