"""The LoRA SGMV kernels (C on CPU; Triton under TRITON_INTERPRET=1) against a float64 reference row by row, at
several row counts and groupings of rows by adapter, fused layers (several parts) included."""
from __future__ import annotations

import os

import pytest
import torch

from services.model_worker.kernels import cpu_lora, triton_lora
from services.model_worker.model.lora.batch import LoraBatch
from services.model_worker.model.lora.ops import sgmv_reference

SLOTS, WIDTH, IN = 4, 16, 96
RANKS = torch.tensor([8, 16, 4, 16])
# (outputs of each part): one projection, q/k/v-like, gate/up-like, parts ending inside a block of 16
PARTS = [[80], [64, 32, 32], [48, 48], [40, 20, 13]]
# each row's slot (-1: base): a lone row, all one adapter, mixed and interleaved, no adapter at all but one row
GROUPINGS = [[0], [1] * 7, [-1, 2, 0, 2, -1, 3, 0, 1, 1, 3, -1, 2, 0], [3, -1, -1, -1], [2] * 3 + [0] * 17 + [-1] * 5]


def operands(parts: list[int], rows: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = sum(parts)
    x = torch.randn(rows, IN, generator=g).to(dtype)
    y = torch.randn(rows, out, generator=g).to(dtype)
    # Non-zero past each slot's rank: the kernels must read only the first `rank` columns of each part.
    a = torch.randn(SLOTS, len(parts) * WIDTH, IN, generator=g).to(dtype)
    b = torch.randn(SLOTS, WIDTH, out, generator=g).to(dtype)  # B transposed
    return x, y, a, b


def reference(y, x, a, b, parts, row_slots) -> torch.Tensor:
    """Row by row in float64: y[r] + sum over parts of (x[r] A_p^T) B_p^T, each slot's rank only."""
    want = y.double().clone()
    ends = torch.tensor(parts).cumsum(0).tolist()
    for r, slot in enumerate(row_slots):
        if slot < 0:
            continue
        rank, begin = int(RANKS[slot]), 0
        for p, end in enumerate(ends):
            t = a[slot, p * WIDTH:p * WIDTH + rank].double() @ x[r].double()
            want[r, begin:end] += b[slot, :rank, begin:end].double().t() @ t
            begin = end
    return want


def check(kernel, parts, row_slots, dtype):
    x, y, a, b = operands(parts, len(row_slots), dtype)
    want = reference(y, x, a, b, parts, row_slots)
    batch = LoraBatch.build(torch.tensor(row_slots), RANKS)
    ends = torch.tensor(parts).cumsum(0).tolist()
    kernel(y, x, a, b, ends, batch)
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.15, rtol=2e-2)
    torch.testing.assert_close(y.double(), want, **tolerance)
    base = [r for r, s in enumerate(row_slots) if s < 0]
    if base:  # base rows untouched, bit for bit
        assert torch.equal(y[base].double(), want[base])


@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("row_slots", GROUPINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel(parts, row_slots, dtype):
    library = cpu_lora.load()
    if library is None:
        pytest.skip("no C compiler")
    check(lambda *args: cpu_lora.sgmv(library, *args), parts, row_slots, dtype)


@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("row_slots", GROUPINGS)
def test_torch_reference(parts, row_slots):
    check(sgmv_reference, parts, row_slots, torch.float32)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_lora.available(),
                    reason="Triton kernels run on CPU only in Triton's interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("parts", PARTS)
@pytest.mark.parametrize("row_slots", GROUPINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel(parts, row_slots, dtype):
    check(triton_lora.sgmv, parts, row_slots, dtype)


def test_rows_are_grouped_by_slot():
    batch = LoraBatch.build(torch.tensor([2, -1, 0, 2, 0, -1, 2]), RANKS)
    assert batch.slots.tolist() == [0, 2] and batch.starts.tolist() == [0, 2, 5]
    assert batch.rows.tolist() == [2, 4, 0, 3, 6] and batch.ranks.tolist() == [8, 4] and batch.max_rows == 3
    assert LoraBatch.build(torch.tensor([-1, -1]), RANKS) is None
