"""The RMSNorm C kernel (rms_norm.c), called through ctypes."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("rms_norm.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def load(source: pathlib.Path = SOURCE) -> ctypes.CDLL | None:
    """The compiled kernel, or None (with a warning) where it cannot be built. source: another copy of
    rms_norm.c (a benchmark's older one)."""
    library = build.load(source, "RMSNorm")
    if library is not None:
        library.rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        library.rms_norm.restype = None
        library.rms_norm_rope.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int]
        library.rms_norm_rope.restype = None
    return library


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """(T, D) or (T, H, D) on the CPU in float32 or bf16, each token's values contiguous (tokens may be strided)."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES or weight.dtype != x.dtype or not weight.is_contiguous():
        return False
    if x.dim() == 2:
        return x.stride(1) == 1
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rms_norm(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x as `supports` takes it; weight: (D,), or (W, D) for the rows of each token in turn (one per head)."""
    dim = x.shape[-1]
    group_rows = 1 if x.dim() == 2 else x.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype)
    weight_rows = 1 if weight.dim() == 1 else weight.shape[0]
    library.rms_norm(x.data_ptr(), x.stride(0), group_rows, weight.data_ptr(), weight_rows, out.data_ptr(),
                     x.numel() // dim, dim, eps, _DTYPES[x.dtype])
    return out


def supports_rope(x: torch.Tensor, weight: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """As `supports` for (T, H, D) heads, with both rotary tables (T, 1, D) contiguous in x's dtype."""
    return (x.dim() == 3 and x.shape[-1] % 2 == 0 and supports(x, weight)
            and all(t.dtype == x.dtype and t.device.type == "cpu" and t.is_contiguous()
                    and t.shape == (x.shape[0], 1, x.shape[2]) for t in rope))


def rms_norm_rope(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
                  rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """rms_norm, then the half-split rotary embedding with tables (cos, cos) and (-sin, sin)."""
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype)
    weight_rows = 1 if weight.dim() == 1 else weight.shape[0]
    cos, signed_sin = rope
    library.rms_norm_rope(x.data_ptr(), x.stride(0), x.shape[1], weight.data_ptr(), weight_rows, cos.data_ptr(),
                          signed_sin.data_ptr(), out.data_ptr(), x.numel() // dim, dim, eps, _DTYPES[x.dtype])
    return out
