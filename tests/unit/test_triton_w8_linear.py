"""The GPU's 8-bit-weight Triton kernel against float64 on the dequantized weights, run by Triton's interpreter on CPU."""
import os

import pytest
import torch

from services.model_worker.kernels import triton_w8_linear
from services.model_worker.model.layers.quant.quantize import dequantize
from tests.unit.test_q8_linear import weights

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_w8_linear.available(),
                                reason="runs in Triton's interpreter (tests/conftest.py sets it when triton is there)")


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 160), (5, 40, 288), (17, 96, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_float64_on_the_dequantized_weight(fmt, rows, n, k, dtype):
    q, scales, block_k = weights(fmt, n, k, seed=rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    reference = x.double() @ dequantize(q, scales, block_k, torch.float64).T
    out = triton_w8_linear.w8_linear(x, q, scales, block_k)
    assert out.dtype == dtype and out.shape == (rows, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2 ** -7
    assert (out.double() - reference).abs().max().item() <= tolerance * (reference.abs().max().item() + 1)
