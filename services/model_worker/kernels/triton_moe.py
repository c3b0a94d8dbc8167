"""Mixture-of-experts SwiGLU experts on a GPU in two Triton grouped matmuls (the shape of vLLM's fused_moe).

The step's (token, choice) pairs are sorted by expert and each expert's run is padded to a multiple
of BLOCK_M, so every tile of BLOCK_M rows belongs to one expert: a program multiplies its rows by
that expert's weights only, and experts no pair chose are never read. The first matmul gives
gate and up for every pair (rows gathered from the tokens), the second the down projection
scaled by the pair's routing weight; a token's top-k outputs are then summed.

8-bit experts (int8 rows, or fp8 e4m3 as Qwen's FP8 checkpoints hold them) are loaded as bytes and widened
in registers as kernels/triton_w8_linear.py does (no fp8 arithmetic, so any GPU and the interpreter run
it), each times its scale (one per weight row and block of inputs), before tl.dot: no dequantized copy.

Everything is sized from the shapes alone (the padded length's upper bound, not its value), so
nothing waits on the GPU and a CUDA graph can capture a decode step. Off a GPU the kernels run in
Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check them on CPU.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None

BLOCK_M = 16  # pairs per tile: tl.dot needs at least 16
BLOCK_N = 64
BLOCK_K = 32


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _grouped_matmul_kernel(
        a_ptr, b_ptr, c_ptr, weight_ptr, sorted_pairs_ptr, block_expert_ptr, total_ptr, s_ptr,
        N, K, num_pairs, stride_am, stride_be, stride_bn, stride_bk, stride_cm, stride_se, stride_sn, scale_block,
        ROW_DIV: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, Q8: tl.constexpr,
    ):
        """c[pair, n] = sum_k a[pair // ROW_DIV, k] * b[expert, n, k] (times weight[pair] if SCALE).

        Q8: 0, b in a's dtype; 1, b int8 bytes; 2, b e4m3 bytes; 8-bit b is times s[expert, n, k // scale_block]."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        # Tiles past the padded length (its bound is what the grid is sized by) read and write nothing.
        valid = pid_m * BLOCK_M < tl.load(total_ptr)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_pairs_ptr + rows)
        row_ok = (pair < num_pairs) & valid
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (cols < N) & valid
        a_rows = (pair // ROW_DIV).to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)                                                      # (BM, BK)
            b = tl.load(b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + kk[:, None] * stride_bk,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)                # (BK, BN)
            if Q8 == 2:
                # e4m3 sign-extended and shifted left 7 is a float16 of 2^-8 its value (0xBF80 = -16512 clears
                # the sign's copy in the exponent's top bit); times 256, exact.
                bits = (b.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16512
                b = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            elif Q8 == 1:
                b = b.to(tl.int8, bitcast=True).to(tl.float32)
            if Q8 != 0:
                scale = tl.load(s_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn + k0 // scale_block,
                                mask=col_ok, other=0.0)
                b = b * scale[None, :]  # float32(q * scale): the weight a float32 dequantization holds
                if not (UPCAST or IEEE):
                    b = b.to(a.dtype)
            if UPCAST:  # the interpreter multiplies bf16 wrongly (numpy has none); bf16 products are exact in fp32
                acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            elif IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        if SCALE:
            acc = acc * tl.load(weight_ptr + pair, mask=row_ok, other=0.0)[:, None]
        tl.store(c_ptr + pair[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """(sorted_pairs, block_expert, total): pair indices grouped by expert, each expert's run padded to a
    multiple of block_m with the out-of-range index P; the expert of each tile; the padded length (1-element
    tensor). Sized by the bound P + E * (block_m - 1), so no value is read back to the host."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=ids.device) - start[sorted_experts]
    bound = pairs + num_experts * (block_m - 1)
    bound = -(-bound // block_m) * block_m
    sorted_pairs = torch.full((bound,), pairs, dtype=torch.int64, device=ids.device)
    sorted_pairs[padded_start[sorted_experts] + rank] = order
    tile_starts = torch.arange(0, bound, block_m, device=ids.device)
    block_expert = torch.searchsorted(padded_end, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert, padded_end[-1:]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, scales: tuple[torch.Tensor, int, torch.Tensor, int] | None = None) -> torch.Tensor:
    """x (T, H); w13 (E, 2I, H); w2 (E, H, I); weights, ids (T, K) from the router. Returns (T, H).

    scales: for 8-bit experts (int8 or float8_e4m3fn), (s13 (E, 2I, ceil(H / block13)), block13,
    s2 (E, H, ceil(I / block2)), block2), float32; each block a multiple of BLOCK_K or the whole row."""
    q8 = 0
    if scales is not None:
        q8 = 2 if w13.dtype == torch.float8_e4m3fn else 1
        s13, block13, s2, block2 = scales
        for block, k in ((block13, w13.shape[2]), (block2, w2.shape[2])):
            if block != k and block % BLOCK_K:
                raise ValueError(f"fused_moe: scale blocks of {block} inputs do not split into steps of {BLOCK_K}")
        w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
        s13, s2 = s13.contiguous(), s2.contiguous()
    else:
        s13 = s2 = x  # never read
        block13 = block2 = 1
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_i, _ = w13.shape
    pairs = tokens * top_k
    sorted_pairs, block_expert, total = align_by_expert(ids, num_experts)
    gate_up = torch.empty(pairs, two_i, dtype=x.dtype, device=x.device)
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    pair_weights = weights.reshape(-1).to(torch.float32).contiguous()
    x = x.contiguous()
    common = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32,
                  UPCAST=x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1", Q8=q8)
    tiles = sorted_pairs.numel() // BLOCK_M
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _grouped_matmul_kernel[(tiles, triton.cdiv(two_i, BLOCK_N))](
            x, w13, gate_up, pair_weights, sorted_pairs, block_expert, total, s13, two_i, hidden, pairs,
            x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), gate_up.stride(0),
            s13.stride(0) if q8 else 0, s13.stride(1) if q8 else 0, block13, ROW_DIV=top_k, SCALE=False, **common)
        gate, up = gate_up.chunk(2, dim=-1)
        act = (F.silu(gate) * up).contiguous()
        _grouped_matmul_kernel[(tiles, triton.cdiv(hidden, BLOCK_N))](
            act, w2, down, pair_weights, sorted_pairs, block_expert, total, s2, hidden, two_i // 2, pairs,
            act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), down.stride(0),
            s2.stride(0) if q8 else 0, s2.stride(1) if q8 else 0, block2, ROW_DIV=1, SCALE=True, **common)
    return down.view(tokens, top_k, hidden).sum(dim=1)
