"""y = x W^T with 8-bit weights on a GPU, in one Triton kernel: int8 rows or fp8 e4m3 128 x 128 blocks.

Each program takes a tile of input rows by a tile of output rows and walks K: the weight bytes are
loaded as bytes, widened in registers (int8 converts; e4m3 is moved bit for bit into a float16,
which holds 2^-8 of its value, subnormals included, so the kernel needs no fp8 arithmetic and runs
on any GPU and in Triton's interpreter alike), multiplied by their scale (one per output row and
block of inputs) and fed to tl.dot in the activations' dtype, accumulated in float32.

On a machine without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, read when
triton is imported): that is how the tests check it against a float64 reference.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None

BLOCK_M = 16  # input rows per program: tl.dot needs at least 16
BLOCK_N = 64  # output rows per program
BLOCK_K = 64  # inputs per step: divides fp8's 128-wide scale blocks, so a step has one scale a row


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _w8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, scale_cols, scale_block,
                          stride_x, stride_out, FP8: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                        other=0.0)
            raw = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                          other=0)  # (BLOCK_N, BLOCK_K) bytes
            if FP8:
                # Sign-extended and shifted left 7: e4m3's exponent and mantissa land in float16's low exponent
                # and top mantissa bits; the mask (0xBF80) clears the sign's copy in the exponent's top bit.
                bits = (raw.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16512
                w = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            else:
                w = raw.to(tl.int8, bitcast=True).to(tl.float32)
            scale = tl.load(s_ptr + cols * scale_cols + k0 // scale_block, mask=cols < N, other=0.0)
            w = w * scale[:, None]
            if UPCAST or IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


def w8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """x: (..., K); weight: (N, K) int8 or float8_e4m3fn; scales: (N, ceil(K / block_k)) float32, block_k a
    multiple of BLOCK_K or K itself. Returns x @ (weight * scales).T, (..., N) in x's dtype."""
    if block_k != weight.shape[1] and block_k % BLOCK_K:
        raise ValueError(f"w8_linear: scale blocks of {block_k} inputs do not split into steps of {BLOCK_K}")
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    fp8 = weight.dtype == torch.float8_e4m3fn
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _w8_linear_kernel[grid](
        rows, weight.view(torch.uint8), scales, out, m, n, k, scales.shape[1], block_k, rows.stride(0), out.stride(0),
        FP8=fp8, IEEE=x.dtype == torch.float32,
        # Triton's interpreter multiplies bfloat16 wrongly (numpy has no bfloat16): upcast there.
        UPCAST=x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out.view(*x.shape[:-1], n)
