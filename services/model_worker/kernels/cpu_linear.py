"""The bf16 matmul C kernels for decode batches, called through ctypes: a few rows
(small_batch_linear.c, AVX512-BF16) and up to a few dozen (amx_linear.c, AMX tiles)."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("small_batch_linear.c")
AMX_SOURCE = pathlib.Path(__file__).with_name("amx_linear.c")


def load() -> ctypes.CDLL | None:
    """The compiled kernel; None where it cannot be built or the CPU has no AVX512-BF16."""
    library = build.load(SOURCE, "small-batch linear")
    if library is None or not library.small_batch_linear_supported():
        return None
    library.small_batch_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    library.small_batch_linear.restype = ctypes.c_int
    return library


def load_amx() -> ctypes.CDLL | None:
    """The AMX kernel; None where it cannot be built, the CPU has no AMX-BF16 or the OS refuses its tile state."""
    library = build.load(AMX_SOURCE, "AMX linear")
    if library is None or not library.amx_linear_supported():
        return None
    library.amx_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    library.amx_linear.restype = ctypes.c_int
    return library


def supports(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 32 == 0


def small_batch_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: (..., K) bf16; weight: (N, K) bf16, contiguous. Returns x @ weight.T, (..., N) bf16."""
    return _call(library.small_batch_linear, x, weight)


def amx_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As small_batch_linear, on AMX tiles (N a multiple of 32 too)."""
    return _call(library.amx_linear, x, weight)


def _call(kernel, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # A decode step's activations are already (rows, K) and contiguous: no reshape or view ops then.
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.bfloat16)
    status = kernel(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0], weight.shape[0],
                    weight.shape[1])
    if status != 0:
        raise RuntimeError(f"{kernel.__name__} failed with status {status} for {tuple(rows.shape)} x "
                           f"{tuple(weight.shape)}")
    return out if flat else out.view(*x.shape[:-1], weight.shape[0])
