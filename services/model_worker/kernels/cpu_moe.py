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
    return library


def supports(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Contiguous CPU weights in float32 or bf16."""
    return (w13.device.type == "cpu" and w13.dtype in _DTYPES and w2.dtype == w13.dtype
            and w13.is_contiguous() and w2.is_contiguous())


def moe_experts(library: ctypes.CDLL, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """x (T, H) in the weights' dtype; weights (T, K) and ids (T, K) from the router. Returns (T, H)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    intermediate = w2.shape[2]
    x = x.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    scratch = torch.empty(tokens * top_k * (2 * hidden + intermediate), dtype=torch.float32)
    library.moe_experts(x.data_ptr(), ids.data_ptr(), weights.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                        out.data_ptr(), scratch.data_ptr(), tokens, top_k, w13.shape[0], hidden, intermediate,
                        _DTYPES[x.dtype])
    return out
