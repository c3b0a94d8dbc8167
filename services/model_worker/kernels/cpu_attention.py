"""The paged decode-attention C kernel (paged_attention.c) and its cache write, called through ctypes; caches in
the query's dtype or in 8 bits (fp8, int8: model/layers/attention/kv_quant.py)."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("paged_attention.c")
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_int] * 7 + [ctypes.c_float]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# paged_attention.c's kv_kind of each cache dtype; any other is the query's own (0).
KV_KINDS = {torch.float8_e4m3fn: 1, torch.int8: 2}


def load(source: pathlib.Path = SOURCE) -> ctypes.CDLL | None:
    """The compiled kernel, or None (with a warning) where it cannot be built. source: another copy of
    paged_attention.c (a benchmark's older one)."""
    library = build.load(source, "attention")
    if library is not None:
        library.paged_decode_attention.argtypes = _ARGTYPES
        library.paged_decode_attention.restype = ctypes.c_int
        library.write_kv.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3 + \
            [ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        library.write_kv.restype = ctypes.c_int
        if hasattr(library, "write_kv_quant"):  # a benchmark's older copy may lack the 8-bit entries
            library.paged_decode_attention_kv.argtypes = _ARGTYPES + [ctypes.c_int] + [ctypes.c_void_p] * 2
            library.paged_decode_attention_kv.restype = ctypes.c_int
            library.write_kv_quant.argtypes = library.write_kv.argtypes + [ctypes.c_int] + [ctypes.c_void_p] * 2
            library.write_kv_quant.restype = ctypes.c_int
        if hasattr(library, "paged_attention_prefetch_runs"):
            library.paged_attention_prefetch_runs.argtypes = []
            library.paged_attention_prefetch_runs.restype = ctypes.c_int
            library.paged_attention_set_prefetch_runs.argtypes = [ctypes.c_int]
            library.paged_attention_set_prefetch_runs.restype = None
    return library


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def can_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> bool:
    """k, v (T, Hkv, D) with each token's heads contiguous, contiguous caches of their dtype (or 8-bit ones with
    contiguous float32 scales, from bf16 or float32 rows), int64 slots, on the CPU."""
    if k_cache.dtype in KV_KINDS:
        same = (k.dtype == v.dtype and k.dtype in _DTYPES and k_cache.dtype == v_cache.dtype and k.shape[2] <= 1024
                and k_scale is not None and v_scale is not None
                and all(s.dtype == torch.float32 and s.is_contiguous() for s in (k_scale, v_scale)))
    else:
        same = k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
    return (k.device.type == "cpu" and same
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)))


def write_kv(library: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k_cache[:, slot_mapping[t]] = k[t] (and v alike), as can_write_kv takes them; raises on a bad slot.

    An 8-bit cache gets the rows quantized as kv_quant.quantize does, bit for bit (int8: their scales into
    k_scale, v_scale at [head, slot])."""
    num_kv_heads, num_slots, head_dim = k_cache.shape
    kind = KV_KINDS.get(k_cache.dtype, 0)
    args = (k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), k.shape[0], num_kv_heads, num_slots, head_dim, k.element_size())
    if kind:
        status = library.write_kv_quant(*args, kind, k_scale.data_ptr(), v_scale.data_ptr())
    else:
        status = library.write_kv(*args)
    if status != 0:
        raise IndexError(f"a slot in the step's slot mapping is outside the cache's {num_slots} slots")


def paged_decode_attention(library: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                           scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q: (N, H, D), the last position of each of N sequences; caches: (Hkv, slots, D) on the CPU, in q's dtype
    or 8-bit with their float32 scales (fp8: (1,) each; int8: (Hkv, slots)), widened in registers.

    context_lens: (N,) int32, >= 1; block_tables: (N, max_blocks) int32. Returns (N, H, D).
    Raises IndexError, reading nothing, where a block the context reaches is not in the table or the pool.
    """
    q = q.contiguous()
    context_lens, block_tables = context_lens.contiguous(), block_tables.contiguous()
    kind = KV_KINDS.get(k_cache.dtype, 0)
    if kind:
        assert k_cache.dtype == v_cache.dtype and q.dtype in _DTYPES
        assert all(s.dtype == torch.float32 and s.is_contiguous() for s in (k_scale, v_scale))
    else:
        assert q.dtype == k_cache.dtype == v_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert context_lens.dtype == block_tables.dtype == torch.int32
    # The kernel reads one length and one table row per query row: fewer would be read past their end.
    assert context_lens.shape == (q.shape[0],) and block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0]
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    args = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), context_lens.data_ptr(),
            block_tables.data_ptr(), k_cache.shape[1], num_seqs, num_heads, k_cache.shape[0], head_dim, block_size,
            block_tables.shape[1], _DTYPES[q.dtype], scale)
    if kind:
        status = library.paged_decode_attention_kv(*args, kind, k_scale.data_ptr(), v_scale.data_ptr())
    else:
        status = library.paged_decode_attention(*args)
    num_blocks = k_cache.shape[1] // block_size
    if status == -3:
        raise IndexError(f"a block table names a block outside the cache's {num_blocks} blocks")
    if status == -4:
        raise IndexError(f"a context is longer than its block table's {block_tables.shape[1]} blocks "
                         f"of {block_size} slots")
    if status != 0:
        raise RuntimeError(f"paged_decode_attention failed with status {status} "
                           f"(heads {num_heads}, KV heads {k_cache.shape[0]}, head_dim {head_dim})")
    return out
