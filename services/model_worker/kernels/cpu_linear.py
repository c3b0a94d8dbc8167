"""The small-batch bf16 matmul C kernel (small_batch_linear.c), called through ctypes."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("small_batch_linear.c")


def load() -> ctypes.CDLL | None:
    """The compiled kernel; None where it cannot be built or the CPU has no AVX512-BF16."""
    library = build.load(SOURCE, "small-batch linear")
    if library is None or not library.small_batch_linear_supported():
        return None
    library.small_batch_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    library.small_batch_linear.restype = ctypes.c_int
    return library


def supports(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 32 == 0


def small_batch_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: (..., K) bf16; weight: (N, K) bf16, contiguous. Returns x @ weight.T, (..., N) bf16."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.bfloat16)
    status = library.small_batch_linear(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0],
                                        weight.shape[0], weight.shape[1])
    if status != 0:
        raise RuntimeError(f"small_batch_linear failed with status {status} for {tuple(rows.shape)} x "
                           f"{tuple(weight.shape)}")
    return out.view(*x.shape[:-1], weight.shape[0])
