"""Paged attention for a whole step in one Triton kernel: decodes, prompt chunks and prefix hits alike.

Each program takes one sequence, one KV head and a tile of query rows. The rows are (query
token, query head of this KV head's group) pairs, so a decode step's grouped heads share one
tile and each key is read once per group. Keys and values are read in place from the paged
cache through the block table, with an online softmax in float32. Queries sit at the end of
their sequence's context, so a row at position p attends to keys 0..p: the same rule covers a
decode (one row, the whole context), a fresh prompt (causal) and a chunk after cached blocks.

When a step has too few programs to fill the GPU (a few sequences with long contexts), each
sequence's keys are split into partitions, one program each, and a second kernel combines the
partial results (flash-decoding; see num_partitions).

The cache may hold 8-bit keys and values: e4m3 bytes with one scale per layer, or int8 with one
scale per (KV head, slot). They are loaded as bytes and widened in registers (e4m3 bit for bit,
as in triton_w8_linear, so no fp8 arithmetic is needed), which is exact in the queries' dtype;
the key scales multiply the scores and the value scales the softmax weights, in float32.

Triton comes with torch's CUDA wheels. On a machine without a GPU the kernel runs in Triton's
interpreter (TRITON_INTERPRET=1, read when this module is imported), which is how the tests
check it against a float64 reference.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None

BLOCK_M = 16  # query rows per program: tl.dot needs at least 16
BLOCK_N = 32  # keys per iteration
# The split: a partition holds at least this many keys (fewer would cost more in partial results
# written and combined than its programs gain), and a step aims for this many programs per SM.
MIN_PARTITION = 256
PROGRAMS_PER_SM = 2
MAX_PARTITIONS = 128  # bounds the combining kernel's vector of partitions
CPU_MULTIPROCESSORS = 4  # under Triton's interpreter: a fixed stand-in, so the choice is the same on every machine
COMBINE_CHUNK = 16  # partitions per iteration of the combining kernel


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
    def _widen(raw, dtype):
        """8-bit cache values as dtype: uint8 bytes hold e4m3 bits, int8 holds integers."""
        if raw.dtype == tl.uint8:
            # Sign-extended and shifted left 7: e4m3's exponent and mantissa land in float16's low exponent
            # and top mantissa bits; the mask (0xBF80) clears the sign's copy in the exponent's top bit.
            bits = (raw.to(tl.int8, bitcast=True).to(tl.int16) << 7) & -16512
            return (bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(dtype)
        else:
            # Through float32: the interpreter converts integers to bfloat16 by their bits.
            return raw.to(tl.float32).to(dtype)

    @triton.jit
    def _cache_scales(scale_ptr, kv_head, stride_h, slot, n_ok, INT8: tl.constexpr):
        """The scales of the keys at slot, shaped (1, N) to multiply scores: int8 keeps one per
        (KV head, slot), e4m3 one for the layer."""
        if INT8:
            return tl.load(scale_ptr + kv_head.to(tl.int64) * stride_h + slot, mask=n_ok, other=0.0)[None, :]
        else:
            return tl.load(scale_ptr)

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, query_start_ptr, context_lens_ptr, block_tables_ptr,
        part_out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, scale, num_partitions,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_ks, stride_vh, stride_vs, stride_bt,
        stride_pt, stride_ph, stride_pp, stride_lt, stride_lh, stride_ksh, stride_vsh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
        SPLIT: tl.constexpr, MIN_PARTITION: tl.constexpr,
    ):
        """SPLIT: axis 2 is (tile, partition); each program writes its rows' partial output and
        log-sum-exp over its partition's keys instead of the output. The caches' element type says what
        they hold (uint8: e4m3 bytes, int8: int8; either: scaled by the scale pointers, int8's rows
        stride_ksh / stride_vsh apart per KV head), a constant when the kernel compiles."""
        EIGHT_BIT: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.uint8 or k_cache_ptr.dtype.element_ty == tl.int8
        INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        if SPLIT:
            tile = tl.program_id(2) // num_partitions
            part = tl.program_id(2) % num_partitions
        else:
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
        first_key = 0
        if SPLIT:
            # Each sequence cuts its own context into equal partitions, read here from context_lens:
            # the grid depends on shapes alone, so one captured graph serves every context length.
            part_len = tl.maximum(tl.cdiv(tl.cdiv(context, num_partitions), BLOCK_N) * BLOCK_N, MIN_PARTITION)
            first_key = part * part_len
            num_keys = tl.minimum(num_keys, first_key + part_len)  # past the end: an empty range
        for start in range(first_key, num_keys, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < num_keys
            block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + n // PAGE, mask=n_ok, other=0)
            slot = block.to(tl.int64) * PAGE + n % PAGE
            k = tl.load(k_cache_ptr + kv_head.to(tl.int64) * stride_kh + slot[None, :] * stride_ks + d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0)                      # (D, N)
            if EIGHT_BIT:
                k = _widen(k, q.dtype)
            s = _dot(q, k, IEEE, UPCAST)
            if EIGHT_BIT:
                s = s * _cache_scales(k_scale_ptr, kv_head, stride_ksh, slot, n_ok, INT8)
            s = s * scale
            visible = (n[None, :] <= position[:, None]) & n_ok[None, :] & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp() stays finite.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - shift[:, None])
            alpha = tl.exp(m - shift)
            v = tl.load(v_cache_ptr + kv_head.to(tl.int64) * stride_vh + slot[:, None] * stride_vs + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0)                      # (N, D)
            if EIGHT_BIT:
                # A value's scale rides on its softmax weight: one multiply per key, not per element.
                v = _widen(v, q.dtype)
                v_scales = _cache_scales(v_scale_ptr, kv_head, stride_vsh, slot, n_ok, INT8)
                pv = _dot((p * v_scales).to(v.dtype), v, IEEE, UPCAST)
            else:
                pv = _dot(p.to(v.dtype), v, IEEE, UPCAST)
            acc = acc * alpha[:, None] + pv
            denom = denom * alpha + tl.sum(p, 1)
            m = m_new
        out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        row = (q_start + token).to(tl.int64)
        if SPLIT:
            # A row that saw no key here (a partition past its position) gets weight exp(-inf) = 0.
            lse = tl.where(denom == 0.0, float("-inf"), m + tl.log(tl.where(denom == 0.0, 1.0, denom)))
            tl.store(lse_ptr + row * stride_lt + head * stride_lh + part, lse, mask=row_ok)
            part_out = part_out_ptr + part * stride_pp
            tl.store(part_out + row[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :], out,
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _combine_partitions_kernel(
        out_ptr, part_out_ptr, lse_ptr, num_partitions,
        stride_ot, stride_oh, stride_pt, stride_ph, stride_pp, stride_lt, stride_lh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr,
    ):
        """One (token, head): the partitions' outputs, each weighted by its share exp(lse_i - lse) of the softmax."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        lse_row = lse_ptr + row * stride_lt + head * stride_lh
        p = tl.arange(0, BLOCK_P)
        lse = tl.load(lse_row + p, mask=p < num_partitions, other=float("-inf"))
        top = tl.max(lse, 0)
        shift = tl.where(top == float("-inf"), 0.0, top)  # every partition empty: all weights 0, output 0
        total = tl.sum(tl.exp(lse - shift), 0)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, num_partitions, CHUNK):
            c = start + tl.arange(0, CHUNK)
            c_ok = c < num_partitions
            weight = tl.exp(tl.load(lse_row + c, mask=c_ok, other=float("-inf")) - shift)
            part = tl.load(part_out_ptr + row * stride_pt + head * stride_ph + c[:, None] * stride_pp + d[None, :],
                           mask=c_ok[:, None] & d_ok[None, :], other=0.0)              # (CHUNK, D)
            acc += tl.sum(weight[:, None] * part, 0)
        out = acc / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (a fixed stand-in off CUDA, where the interpreter runs)."""
    if device.type != "cuda":
        return CPU_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_partitions(num_programs: int, max_keys: int, device: torch.device) -> int:
    """How many partitions each sequence's keys are split into; 1: the single pass.

    num_programs: the single pass's programs (sequences x KV heads x query tiles). max_keys: what
    the block tables' width can hold, an upper bound on every context. Both are shapes, never
    values read from the device: under a CUDA graph they are the bucket's batch size and the
    graph's table width (--max-model-len), so the choice is fixed per graph, and each sequence
    cuts its own context in the kernel. In an eager step the table is as wide as the step's
    longest context, so the choice follows it.
    """
    if max_keys < 2 * MIN_PARTITION:  # nothing to split: one partition would hold every key
        return 1
    target = PROGRAMS_PER_SM * multiprocessors(device)
    if num_programs * 2 > target:  # the single pass keeps the GPU busy enough already
        return 1
    return min(triton.cdiv(target, num_programs), triton.cdiv(max_keys, MIN_PARTITION), MAX_PARTITIONS)


def _as_kernel_caches(k_cache, v_cache, k_scale, v_scale):
    """The caches and scales as the kernel reads them: e4m3 as its bytes (the kernel widens them by
    bits, so neither the GPU nor the interpreter needs fp8 arithmetic); a cache in a float dtype
    passes itself in place of the scales it does not have."""
    if k_cache.dtype not in (torch.float8_e4m3fn, torch.int8):
        return k_cache, v_cache, k_cache, v_cache
    if k_scale is None or v_scale is None:
        raise ValueError(f"paged_attention: a {k_cache.dtype} cache needs k_scale and v_scale")
    if k_cache.dtype == torch.float8_e4m3fn:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale
    return k_cache, v_cache, k_scale, v_scale


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_query_len: int,
                    scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, partitions: int | None = None) -> torch.Tensor:
    """q: (T, H, D) flat over the batch; caches: (Hkv, slots, D), this step's keys already written.

    query_start_loc: (B + 1,) cu_seqlens; context_lens: (B,) tokens after this step; block_tables:
    (B, max_blocks). k_scale, v_scale: float32, for 8-bit caches only: (1,) for float8_e4m3fn,
    (Hkv, slots) for int8. partitions: how many to split each sequence's keys into; None:
    num_partitions() chooses. Returns (T, H, D) in q's dtype. No host sync: every shape comes from the arguments.
    """
    k_cache, v_cache, k_scale, v_scale = _as_kernel_caches(k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[0]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    num_seqs = context_lens.shape[0]
    tiles = triton.cdiv(max_query_len * group, BLOCK_M)
    if partitions is None:
        partitions = num_partitions(num_seqs * num_kv_heads * tiles, block_tables.shape[1] * block_size, q.device)
    split = partitions > 1
    block_d = triton.next_power_of_2(max(head_dim, 16))
    # Under graph capture these come from the graph's private pool, like every activation.
    part_out = torch.empty(num_tokens, num_heads, partitions, head_dim, dtype=torch.float32, device=q.device) \
        if split else out
    lse = torch.empty(num_tokens, num_heads, partitions, dtype=torch.float32, device=q.device) if split else out
    # Triton launches on the current device; on a GPU other than cuda:0 that must be q's.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _paged_attention_kernel[(num_seqs, num_kv_heads, tiles * partitions)](
            out, q, k_cache, v_cache, query_start_loc, context_lens, block_tables, part_out, lse, k_scale, v_scale,
            scale, partitions,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), block_tables.stride(0),
            part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0, lse.stride(0), lse.stride(1),
            k_scale.stride(0), v_scale.stride(0),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=block_size,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
            # Triton's interpreter multiplies bfloat16 wrongly (numpy has no bfloat16): upcast there.
            UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
            SPLIT=split, MIN_PARTITION=MIN_PARTITION,
        )
        if split:
            _combine_partitions_kernel[(num_tokens, num_heads)](
                out, part_out, lse, partitions, out.stride(0), out.stride(1),
                part_out.stride(0), part_out.stride(1), part_out.stride(2), lse.stride(0), lse.stride(1),
                HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(partitions), CHUNK=COMBINE_CHUNK,
            )
    return out
