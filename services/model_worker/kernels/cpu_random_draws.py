"""The counter-based uniforms' C kernel (random_draws.c), called through ctypes."""
from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("random_draws.c")


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel (built once per process), or None (with a warning) where it cannot be built."""
    library = build.load(SOURCE, "random draws")
    if library is not None:
        library.draw_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        library.draw_rows.restype = None
    return library


def draw(words: torch.Tensor, ids: torch.Tensor, exponential: bool) -> torch.Tensor | None:
    """(R, W) float32 uniforms, or their exponential variates, for (R, 3) int64 words and (1 or R, W) int64
    token ids on the CPU; None where the kernel does not apply (the torch path computes the same uniforms)."""
    if (words.device.type != "cpu" or ids.device.type != "cpu" or words.dtype != torch.int64
            or ids.dtype != torch.int64 or (library := load()) is None):
        return None
    words = words.contiguous()
    row_stride, column_stride = ids.stride()
    if column_stride != 1:
        ids = ids.contiguous()
        row_stride = ids.stride(0)
    rows, width = words.shape[0], ids.shape[1]
    out = torch.empty(rows, width)
    if rows and width:
        library.draw_rows(words.data_ptr(), ids.data_ptr(), row_stride if ids.shape[0] > 1 else 0, rows, width,
                          int(exponential), out.data_ptr())
    return out
