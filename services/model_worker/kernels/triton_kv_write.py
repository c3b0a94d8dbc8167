"""A step's keys and values into their cache slots in one Triton kernel, quantized for an 8-bit cache.

Each program takes one token: its k and v rows of every KV head. An e4m3 cache gets x / scale,
clamped to +-448 and rounded to nearest even by arithmetic on its float32 bits (no fp8
type is needed, so the kernel runs on any GPU and in Triton's interpreter); an int8 cache gets
round(x / s) with s = max|x| / 127 per (head, token), stored beside it; a float cache gets a copy.
Divisions are IEEE-rounded (div_rn), so the bytes equal torch's for the same arithmetic.

On a machine without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, read when
triton is imported): that is how the tests check it against torch.
"""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _e4m3_bits(y):
        """The e4m3fn byte of each float32 y, rounded to nearest even as torch converts; |y| > 448 saturates."""
        a = tl.minimum(tl.abs(y), 448.0)
        bits = a.to(tl.int32, bitcast=True)
        # At or above 2^-6 (normal): round float32's mantissa to 3 bits, then rebias 127 -> 7 (120 << 3).
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960
        # Below (subnormal, steps of 2^-9): adding 2^14, whose float32 step is 2^-9, rounds to that step
        # in hardware; the sum's low bits count the steps (8: rounded up to the smallest normal, code 8).
        subnormal = (a + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        code = tl.where(bits >= 121 << 23, normal, subnormal)
        code = tl.where(y != y, 0x7F, code)  # NaN, as torch writes it
        sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _store_rows(x, cache_ptr, scale_ptr, heads, head_ok, d, mask, slot, stride_ch, stride_cs, stride_sh):
        """x: (H, D) float32 rows of one token, into cache[heads, slot] (and int8's scale[heads, slot])."""
        offsets = heads[:, None].to(tl.int64) * stride_ch + slot * stride_cs + d[None, :]
        if cache_ptr.dtype.element_ty == tl.uint8:
            tl.store(cache_ptr + offsets, _e4m3_bits(tl.math.div_rn(x, tl.load(scale_ptr))), mask=mask)
        elif cache_ptr.dtype.element_ty == tl.int8:
            amax = tl.max(tl.abs(x), 1)
            s = tl.math.div_rn(amax, 127.0)                                                 # (H,)
            y = tl.math.div_rn(x, tl.where(s == 0.0, 1.0, s)[:, None])
            # Adding 1.5 * 2^23 (float32 step 1) rounds |y| <= 127 to an integer, to nearest even; the
            # sum's bits less the constant's are that integer.
            q = (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
            tl.store(cache_ptr + offsets, q.to(tl.int8), mask=mask)
            tl.store(scale_ptr + heads.to(tl.int64) * stride_sh + slot, s, mask=head_ok)
        else:
            tl.store(cache_ptr + offsets, x.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
                         num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_kch, stride_kcs, stride_vch, stride_vcs, stride_ksh, stride_vsh,
                         HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_mapping_ptr + token)
        heads = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        head_ok = heads < num_kv_heads
        mask = head_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        _store_rows(k.to(tl.float32), k_cache_ptr, k_scale_ptr, heads, head_ok, d, mask, slot,
                    stride_kch, stride_kcs, stride_ksh)
        _store_rows(v.to(tl.float32), v_cache_ptr, v_scale_ptr, heads, head_ok, d, mask, slot,
                    stride_vch, stride_vcs, stride_vsh)


def _as_kernel_cache(cache: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A cache as the kernel writes it (e4m3 as its bytes), its scales (itself where it has none) and their
    head stride (int8's alone is per head)."""
    if cache.dtype not in (torch.float8_e4m3fn, torch.int8):
        return cache, cache, 0
    if scale is None:
        raise ValueError(f"write_kv: a {cache.dtype} cache needs its scales")
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8), scale, 0
    return cache, scale, scale.stride(0)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: (T, Hkv, D) in the model's dtype, into the caches (Hkv, slots, D) at slot_mapping (T,) int64.

    float8_e4m3fn caches read k_scale, v_scale (1,) float32; int8 caches write this step's scales into
    k_scale, v_scale (Hkv, slots) float32 at the same slots; other caches take a copy and no scales.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv: k and v rows must be contiguous")
    k_cache_in, k_scale_in, stride_ksh = _as_kernel_cache(k_cache, k_scale)
    v_cache_in, v_scale_in, stride_vsh = _as_kernel_cache(v_cache, v_scale)
    # Triton launches on the current device; on a GPU other than cuda:0 that must be k's.
    with torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext():
        _write_kv_kernel[(num_tokens,)](
            k, v, k_cache_in, v_cache_in, slot_mapping, k_scale_in, v_scale_in, num_kv_heads,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache_in.stride(0), k_cache_in.stride(1),
            v_cache_in.stride(0), v_cache_in.stride(1), stride_ksh, stride_vsh,
            HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
