"""The fp8 decode kernel (q8_linear, few rows): every e4m3 byte exactly, block sums, and float64 on the dequantized weight."""
import pytest
import torch

from services.model_worker.kernels import cpu_q8_linear
from services.model_worker.model.layers.quant.quantize import dequantize
from tests.unit import test_q8_linear

needs_avx512 = test_q8_linear.needs_avx512
kernels = test_q8_linear.kernels  # the module's fixture, shared


def gemv(kernels, x, q, scales, block_k):
    return cpu_q8_linear.linear(kernels, x, q, scales, block_k, amx=False)


@needs_avx512
@pytest.mark.parametrize("k,column", [(256, 200), (160, 150), (1024, 5)])  # a later block; the 32-input tail; the first
def test_every_e4m3_byte_times_one_is_its_value_times_the_scale(kernels, k, column):
    """Row v holds byte v at `column`: zero, the subnormals, the normals up to +-448 and the NaNs, each read exactly."""
    q = torch.zeros(256, k, dtype=torch.uint8)
    q[:, column] = torch.arange(256, dtype=torch.uint8)
    q = q.view(torch.float8_e4m3fn)
    blocks = -(-k // 128)
    scales = torch.rand(256, blocks, generator=torch.Generator().manual_seed(k)) + 0.5
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    x[0, column] = 1.0
    out = gemv(kernels, x, q, scales, 128)[0]
    expected = (q[:, column].float() * scales[:, column // 128]).bfloat16()  # torch's own e4m3 decoding
    assert torch.equal(out.isnan(), expected.isnan()) and out.isnan().sum() == 2
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


@needs_avx512
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 16])
@pytest.mark.parametrize("k,block_k", [(1024, 128), (288, 128), (384, 192), (256, 64)])
def test_exact_when_each_block_sum_is_exact(kernels, rows, k, block_k):
    """Small integers times powers of two: every product, block sum and scaled total is exact in float32, so the
    output is the float64 result rounded to bf16 once, whatever order the kernel adds in."""
    gen = torch.Generator().manual_seed(rows * k + block_k)
    q = torch.randint(-8, 9, (40, k), generator=gen).float().to(torch.float8_e4m3fn)
    scales = 2.0 ** torch.randint(-6, 3, (40, -(-k // block_k)), generator=gen).float()
    x = torch.randint(-4, 5, (rows, k), generator=gen).bfloat16()
    reference = x.double() @ dequantize(q, scales, block_k, torch.float64).T
    assert torch.equal(gemv(kernels, x, q, scales, block_k), reference.bfloat16())


@needs_avx512
@pytest.mark.parametrize("k,block_k", [(1024, 128), (3072, 128), (160, 128), (320, 64), (288, 96)])
def test_matches_float64_within_one_bf16_rounding(kernels, k, block_k):
    """Random weights at every scale: off the float64 product by the bf16 rounding of the output and float32's
    rounding of the sums (K * 2^-24 of the sum of |products|, far above what it reaches)."""
    gen = torch.Generator().manual_seed(k + block_k)
    n = 72
    q = (torch.randn(n, k, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    q.view(torch.uint8)[0, :128] = torch.arange(128, dtype=torch.uint8) % 0x7F  # every magnitude but NaN
    scales = torch.rand(n, -(-k // block_k), generator=gen) * 1e-2 + 1e-4
    x = torch.randn(7, k, generator=gen).bfloat16()
    weight = dequantize(q, scales, block_k, torch.float64)
    reference = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    for rows in (1, 4, 7):
        out = gemv(kernels, x[:rows], q, scales, block_k).double()
        allowed = reference[:rows].abs() * 2 ** -8 + magnitude[:rows] * k * 2 ** -24
        assert ((out - reference[:rows]).abs() <= allowed).all()


@needs_avx512
def test_each_row_is_the_same_alone_or_with_others(kernels):
    """A decode step's sequences do not change one another's bits: up to 16 rows at once equal each row alone."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(96, 1024, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.rand(96, 8, generator=gen)
    x = torch.randn(16, 1024, generator=gen).bfloat16()
    alone = torch.cat([gemv(kernels, x[i:i + 1], q, scales, 128) for i in range(16)])
    for rows in (2, 3, 4, 5, 7, 16):
        assert torch.equal(gemv(kernels, x[:rows], q, scales, 128), alone[:rows])
