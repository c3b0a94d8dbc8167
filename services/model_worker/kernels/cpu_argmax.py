"""The argmax C kernel (argmax.c), called through ctypes, with torch's argmax wherever it does not apply."""
from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("argmax.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel (built once per process), or None (with a warning) where it cannot be built."""
    library = build.load(SOURCE, "argmax")
    if library is not None:
        library.argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int, ctypes.c_void_p]
        library.argmax_rows.restype = None
    return library


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) for (rows, vocab): the C kernel on the CPU for bf16 and float32, torch elsewhere."""
    if (logits.device.type != "cpu" or logits.dtype not in _DTYPES or logits.dim() != 2 or logits.shape[1] == 0
            or logits.stride(1) != 1 or (library := load()) is None):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0),
                        _DTYPES[logits.dtype], out.data_ptr())
    return out
