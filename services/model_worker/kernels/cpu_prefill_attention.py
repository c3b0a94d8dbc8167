"""The prefill attention kernel (prefill_attention.c: AMX tiles, or AVX512-BF16 register tiles on CPUs
without AMX), called through ctypes."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("prefill_attention.c")
_ARGTYPES = ([ctypes.c_void_p, ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                      ctypes.c_int64] + [ctypes.c_int] * 5 + [ctypes.c_float])


def load(source: pathlib.Path = SOURCE) -> ctypes.CDLL | None:
    """The kernel; None where it cannot be built, the CPU has no AVX512-BF16, or it has AMX-BF16 and the OS
    refuses its tile state. source: another copy of prefill_attention.c (a benchmark's older one)."""
    library = build.load(source, "prefill attention")
    if library is None or not library.prefill_attention_supported():
        return None
    library.prefill_attention.argtypes = _ARGTYPES
    library.prefill_attention.restype = ctypes.c_int
    return library


def _rows(t: torch.Tensor) -> bool:
    """(L, heads, D) with each row's heads side by side and each head's values contiguous."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """bf16 on the CPU, a head size the tiles take (a multiple of 32), rows as prefill_attention takes
    them, contiguous caches."""
    tensors = (q, k, v, k_cache, v_cache)
    return (all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors) and q.shape[-1] % 32 == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous() and _rows(q) and _rows(k) and _rows(v))


def prefill_attention(library: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      out: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a prompt's Lq new rows over its Lk keys, into out (Lq, H, D); returns out.

    q: (Lq, H, D). slots None: k, v are (Lq, Hkv, D), the prompt's own rows (Lk = Lq). Else k, v
    are the caches, (Hkv, num_slots, D), contiguous, and slots (Lk,) int64 holds where its keys sit;
    query row i sits at position Lk - Lq + i. Rows of q, k, v and out may be strided (views of a
    step's flat batch), each row's heads contiguous.
    """
    lq, heads, head_dim = q.shape
    if slots is None:
        assert _rows(k) and _rows(v) and k.shape[0] == lq
        lk, kv_heads, k_stride, v_stride, num_slots, slot_ptr = lq, k.shape[1], k.stride(0), v.stride(0), 0, None
    else:
        assert k.is_contiguous() and v.is_contiguous() and slots.dtype == torch.int64 and slots.is_contiguous()
        lk, kv_heads, k_stride, v_stride, num_slots, slot_ptr = slots.shape[0], k.shape[0], 0, 0, k.shape[1], \
            slots.data_ptr()
    assert _rows(out) and out.shape == q.shape and q.dtype == k.dtype == v.dtype == out.dtype == torch.bfloat16
    status = library.prefill_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k_stride, v.data_ptr(), v_stride,
                                       slot_ptr, num_slots, out.data_ptr(), out.stride(0), lq, lk, heads, kv_heads,
                                       head_dim, scale)
    if status == -3:
        raise IndexError(f"a key slot is outside the cache's {num_slots} slots")
    if status == -2:
        raise MemoryError(f"prefill attention: no scratch memory for {lk} keys")
    if status != 0:
        raise RuntimeError(f"prefill_attention failed with status {status} (Lq {lq}, Lk {lk}, heads {heads}, "
                           f"KV heads {kv_heads}, head_dim {head_dim})")
    return out
