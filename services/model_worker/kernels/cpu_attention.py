"""The paged decode-attention C kernel (paged_attention.c), called through ctypes."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("paged_attention.c")
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_int] * 7 + [ctypes.c_float]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


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
    return library


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def can_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> bool:
    """k, v (T, Hkv, D) with each token's heads contiguous, contiguous caches of their dtype, int64 slots, on the CPU."""
    return (k.device.type == "cpu" and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v)))


def write_kv(library: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache[:, slot_mapping[t]] = k[t] (and v alike), as can_write_kv takes them; raises on a bad slot."""
    num_kv_heads, num_slots, head_dim = k_cache.shape
    status = library.write_kv(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                              v_cache.data_ptr(), slot_mapping.data_ptr(), k.shape[0], num_kv_heads, num_slots,
                              head_dim, k.element_size())
    if status != 0:
        raise IndexError(f"a slot in the step's slot mapping is outside the cache's {num_slots} slots")


def paged_decode_attention(library: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q: (N, H, D), the last position of each of N sequences; caches: (Hkv, slots, D) on the CPU.

    context_lens: (N,) int32, >= 1; block_tables: (N, max_blocks) int32. Returns (N, H, D).
    Raises IndexError, reading nothing, where a block the context reaches is not in the table or the pool.
    """
    q = q.contiguous()
    context_lens, block_tables = context_lens.contiguous(), block_tables.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert context_lens.dtype == block_tables.dtype == torch.int32
    # The kernel reads one length and one table row per query row: fewer would be read past their end.
    assert context_lens.shape == (q.shape[0],) and block_tables.dim() == 2 and block_tables.shape[0] == q.shape[0]
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    status = library.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), context_lens.data_ptr(),
        block_tables.data_ptr(), k_cache.shape[1], num_seqs, num_heads, k_cache.shape[0], head_dim, block_size,
        block_tables.shape[1], _DTYPES[q.dtype], scale)
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
