"""Paged attention for a whole step in one Triton kernel: decodes, prompt chunks and prefix hits alike.

Each program takes one sequence, one KV head and a tile of query rows. The rows are (query
token, query head of this KV head's group) pairs, so a decode step's grouped heads share one
tile and each key is read once per group. Keys and values are read in place from the paged
cache through the block table, with an online softmax in float32. Queries sit at the end of
their sequence's context, so a row at position p attends to keys 0..p: the same rule covers a
decode (one row, the whole context), a fresh prompt (causal) and a chunk after cached blocks.

Triton comes with torch's CUDA wheels. On a machine without a GPU the kernel runs in Triton's
interpreter (TRITON_INTERPRET=1, read when this module is imported), which is how the tests
check it against a float64 reference.
"""
from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None

BLOCK_M = 16  # query rows per program: tl.dot needs at least 16
BLOCK_N = 32  # keys per iteration


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """a @ b accumulated in float32. IEEE: exact float32 products (no TF32) for float32 inputs."""
        if UPCAST:  # bf16 products are exact in float32, so this is the same arithmetic
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, query_start_ptr, context_lens_ptr, block_tables_ptr,
        scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        context = tl.load(context_lens_ptr + seq)

        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        token = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = token < q_len
        position = context - q_len + token  # of each query row in its sequence
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM

        q = tl.load(q_ptr + (q_start + token)[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys up to the last position any row of this tile may see; a tile past the queries sees none.
        last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        num_keys = tl.where(tile * BLOCK_M < q_len * GROUP, context - q_len + last_token + 1, 0)
        for start in range(0, num_keys, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < num_keys
            block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + n // PAGE, mask=n_ok, other=0)
            slot = block.to(tl.int64) * PAGE + n % PAGE
            k = tl.load(k_cache_ptr + kv_head.to(tl.int64) * stride_kh + slot[None, :] * stride_ks + d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)                    # (D, N)
            s = _dot(q, k, IEEE, UPCAST)
            s = s * scale
            visible = (n[None, :] <= position[:, None]) & n_ok[None, :] & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp() stays finite.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m - shift)
            v = tl.load(v_cache_ptr + kv_head.to(tl.int64) * stride_vh + slot[:, None] * stride_vs + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)                    # (N, D)
            pv = _dot(p.to(v.dtype), v, IEEE, UPCAST)
            acc = acc * alpha[:, None] + pv
            denom = denom * alpha + tl.sum(p, 1)
            m = m_new
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(out_ptr + (q_start + token)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_query_len: int,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: (T, H, D) flat over the batch; caches: (Hkv, slots, D), this step's keys already written.

    query_start_loc: (B + 1,) cu_seqlens; context_lens: (B,) tokens after this step; block_tables:
    (B, max_blocks). Returns (T, H, D). No host sync: every shape comes from the arguments.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    num_seqs = context_lens.shape[0]
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len * group, BLOCK_M))
    # Triton launches on the current device; on a GPU other than cuda:0 that must be q's.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _paged_attention_kernel[grid](
            out, q, k_cache, v_cache, query_start_loc, context_lens, block_tables, scale,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(max(head_dim, 16)), PAGE=block_size,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
            # Triton's interpreter multiplies bfloat16 wrongly (numpy has no bfloat16): upcast there.
            UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        )
    return out
