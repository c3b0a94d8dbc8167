"""The mixture-of-experts C kernel (moe.c), called through ctypes: grouped SwiGLU experts on the CPU."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("moe.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with a warning) where it cannot be built."""
    library = build.load(SOURCE, "mixture of experts")
    if library is not None:
        library.moe_experts.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] + [ctypes.c_int] * 5
        library.moe_experts.restype = None
        library.moe_experts_q8.argtypes = ([ctypes.c_void_p] * 9 + [ctypes.c_int64] + [ctypes.c_int] * 4
                                           + [ctypes.c_int] * 4)
        library.moe_experts_q8.restype = None
    return library


def supports(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Contiguous CPU weights in float32 or bf16."""
    return (w13.device.type == "cpu" and w13.dtype in _DTYPES and w2.dtype == w13.dtype
            and w13.is_contiguous() and w2.is_contiguous())


def moe_experts(library: ctypes.CDLL, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """x (T, H) in the weights' dtype; weights (T, K) and ids (T, K) from the router. Returns (T, H)."""
    x, ids, weights, out, scratch = _arguments(x, w2, weights, ids)
    (tokens, hidden), top_k = x.shape, ids.shape[1]
    library.moe_experts(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                        out.data_ptr(), scratch.data_ptr(), tokens, top_k, w13.shape[0], hidden, w2.shape[2],
                        _DTYPES[x.dtype])
    return out


def _arguments(x: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> tuple:
    """What both kernels take besides the weights: x, ids (int64) and router weights (float32) contiguous, the
    output (T, H), and the float32 scratch of every (token, expert) pair's gate, up and down rows."""
    (tokens, hidden), top_k, intermediate = x.shape, ids.shape[1], w2.shape[2]
    scratch = torch.empty(tokens * top_k * (2 * hidden + intermediate), dtype=torch.float32)
    x = x.contiguous()
    return (x, ids.to(torch.int64).contiguous(), weights.to(torch.float32).contiguous(), torch.empty_like(x),
            scratch)


def supports_q8(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Contiguous CPU experts in int8 or float8_e4m3fn."""
    return (w13.device.type == "cpu" and w13.dtype in (torch.int8, torch.float8_e4m3fn) and w2.dtype == w13.dtype
            and w13.is_contiguous() and w2.is_contiguous())


def moe_experts_q8(library: ctypes.CDLL, x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, block13: int,
                   w2: torch.Tensor, s2: torch.Tensor, block2: int, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """As moe_experts with 8-bit experts: w13 (E, 2I, H) and w2 (E, H, I) int8 or float8_e4m3fn, their float32
    scales s13 (E, 2I, ceil(H / block13)) and s2 (E, H, ceil(I / block2)). x (T, H) float32 or bf16."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"moe_experts_q8: activations in {x.dtype}; float32 or bfloat16 only")
    x, ids, weights, out, scratch = _arguments(x, w2, weights, ids)
    (tokens, hidden), top_k = x.shape, ids.shape[1]
    s13, s2 = s13.contiguous(), s2.contiguous()
    library.moe_experts_q8(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), w13.data_ptr(), s13.data_ptr(),
                           w2.data_ptr(), s2.data_ptr(), out.data_ptr(), scratch.data_ptr(), tokens, top_k,
                           w13.shape[0], hidden, w2.shape[2], _DTYPES[x.dtype], int(w13.dtype == torch.float8_e4m3fn),
                           block13, block2)
    return out
