"""LoRA for rows grouped by adapter on a GPU (Punica's SGMV) in two Triton kernels: shrink, then expand.

The same layouts and arithmetic as lora.c: a (slots, parts x R, in), b (slots, R, out) (B transposed) with the
scaling folded in; output row o of part p reads columns p x R .. p x R + rank of the shrink. Programs take a
segment (one adapter's rows) by a block of its rows (and, expanding, a block of outputs), so every row
of a segment shares each weight load. Sums are float32 (tl.dot at IEEE precision: the work is a few
hundred thousand products a layer, and the inputs are widened, which Triton's interpreter needs for bf16).

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, read when triton is
imported): that is how the tests check them against the torch reference.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None

BLOCK_M = 16  # rows of a segment per program: tl.dot needs at least 16
BLOCK_K = 64  # inputs per shrink step
BLOCK_O = 64  # outputs per expand program


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, shrunk_ptr, rows_ptr, starts_ptr, slots_ptr, ranks_ptr, K,
                       WIDTH: tl.constexpr, SHRUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        seg = tl.program_id(0)
        start = tl.load(starts_ptr + seg)
        end = tl.load(starts_ptr + seg + 1)
        m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < end
        rows = tl.load(rows_ptr + m, mask=m_ok, other=0)
        slot = tl.load(slots_ptr + seg)
        rank = tl.load(ranks_ptr + seg)
        cols = tl.arange(0, BLOCK_N)
        col_ok = (cols < SHRUNK) & ((cols % WIDTH) < rank)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptr + slot * SHRUNK * K + cols[:, None] * K + ks[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        tl.store(shrunk_ptr + m[:, None] * SHRUNK + cols[None, :], acc, mask=m_ok[:, None] & (cols[None, :] < SHRUNK))

    @triton.jit
    def _expand_kernel(y_ptr, b_ptr, shrunk_ptr, rows_ptr, starts_ptr, slots_ptr, ranks_ptr, ends_ptr, N,
                       WIDTH: tl.constexpr, SHRUNK: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr):
        seg = tl.program_id(0)
        start = tl.load(starts_ptr + seg)
        end = tl.load(starts_ptr + seg + 1)
        m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < end
        rows = tl.load(rows_ptr + m, mask=m_ok, other=0)
        slot = tl.load(slots_ptr + seg)
        rank = tl.load(ranks_ptr + seg)
        o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
        ks = tl.arange(0, BLOCK_R)
        k_ok = ks < rank
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        lo = 0
        for p in tl.static_range(PARTS):
            hi = tl.load(ends_ptr + p)
            o_ok = (o >= lo) & (o < hi)
            t = tl.load(shrunk_ptr + m[:, None] * SHRUNK + p * WIDTH + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(b_ptr + slot * WIDTH * N + ks[:, None] * N + o[None, :], mask=k_ok[:, None] & o_ok[None, :],
                        other=0.0)
            acc += tl.dot(t, b.to(tl.float32), input_precision="ieee")
            lo = hi
        mask = m_ok[:, None] & (o[None, :] < N)
        at = y_ptr + rows[:, None] * N + o[None, :]
        y = tl.load(at, mask=mask, other=0.0)
        tl.store(at, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


_ends: dict[tuple, torch.Tensor] = {}


def sgmv(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part_ends: list[int], batch) -> None:
    """y (T, out) += each segment's x A^T B^T, in place; x (T, in); y and x contiguous.

    a: (slots, parts x R, in); b: (slots, R, out), B transposed; batch: a LoraBatch (moved to y's device here)."""
    batch = batch.to(y.device)
    width, shrunk_width, k, n = b.shape[1], a.shape[1], x.shape[1], y.shape[1]
    key = (tuple(part_ends), y.device)
    ends = _ends.get(key)
    if ends is None:
        ends = _ends[key] = torch.tensor(part_ends, dtype=torch.int64, device=y.device)
    shrunk = torch.empty(batch.rows.numel(), shrunk_width, dtype=torch.float32, device=y.device)
    row_blocks = triton.cdiv(batch.max_rows, BLOCK_M)
    segments = batch.num_segments
    _shrink_kernel[(segments, row_blocks)](
        x, a, shrunk, batch.rows, batch.starts, batch.slots, batch.ranks, k, WIDTH=width, SHRUNK=shrunk_width,
        BLOCK_M=BLOCK_M, BLOCK_N=max(16, triton.next_power_of_2(shrunk_width)), BLOCK_K=BLOCK_K)
    _expand_kernel[(segments, row_blocks, triton.cdiv(n, BLOCK_O))](
        y, b, shrunk, batch.rows, batch.starts, batch.slots, batch.ranks, ends, n, WIDTH=width, SHRUNK=shrunk_width,
        PARTS=len(part_ends), BLOCK_M=BLOCK_M, BLOCK_R=max(16, triton.next_power_of_2(width)), BLOCK_O=BLOCK_O)
