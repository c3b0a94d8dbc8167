"""The paged decode-attention C kernel (paged_attention.c), called through ctypes."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("paged_attention.c")
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_int] * 7 + [ctypes.c_float]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with a warning) where it cannot be built."""
    library = build.load(SOURCE, "attention")
    if library is not None:
        library.paged_decode_attention.argtypes = _ARGTYPES
        library.paged_decode_attention.restype = ctypes.c_int
    return library


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def paged_decode_attention(library: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q: (N, H, D), the last position of each of N sequences; caches: (Hkv, slots, D) on the CPU.

    context_lens: (N,) int32, >= 1; block_tables: (N, max_blocks) int32. Returns (N, H, D).
    """
    q = q.contiguous()
    context_lens, block_tables = context_lens.contiguous(), block_tables.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert context_lens.dtype == block_tables.dtype == torch.int32
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    status = library.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), context_lens.data_ptr(),
        block_tables.data_ptr(), k_cache.shape[1], num_seqs, num_heads, k_cache.shape[0], head_dim, block_size,
        block_tables.shape[1], _DTYPES[q.dtype], scale)
    if status != 0:
        raise RuntimeError(f"paged_decode_attention failed with status {status} "
                           f"(heads {num_heads}, KV heads {k_cache.shape[0]}, head_dim {head_dim})")
    return out
