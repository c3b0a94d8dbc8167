"""The counter-based uniforms' C kernels (random_draws.c), called through ctypes: the draws, and the sampler's
whole exponential race."""
from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("random_draws.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel (built once per process), or None (with a warning) where it cannot be built."""
    library = build.load(SOURCE, "random draws")
    if library is not None:
        library.draw_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]
        library.draw_rows.restype = None
        library.race_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        library.race_rows.restype = None
        library.words_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                       ctypes.c_int64, ctypes.c_void_p]
        library.words_rows.restype = None
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


def words(seeds: tuple[int, ...], counters: tuple[int, ...], stream: int, num_streams: int) -> torch.Tensor | None:
    """(R, 3) int64 draw words for seeds in [0, 2**64) and counters in [0, 2**63); None where the kernel does not
    apply (a value out of range, or no kernel): random_draws.draw_words's Python path."""
    if (library := load()) is None or (counters and min(counters) < 0):
        return None
    try:
        seed_bits = torch.tensor(seeds, dtype=torch.uint64).view(torch.int64)
        counter_values = torch.tensor(counters, dtype=torch.int64)
    except (OverflowError, RuntimeError, TypeError):
        return None
    out = torch.empty(len(seeds), 3, dtype=torch.int64)
    library.words_rows(seed_bits.data_ptr(), counter_values.data_ptr(), stream, num_streams, len(seeds),
                       out.data_ptr())
    return out


def race(candidates: torch.Tensor, words: torch.Tensor, ids: torch.Tensor | None,
         temperature: torch.Tensor | None) -> torch.Tensor | None:
    """(R,) int64: each row's column of the largest exp(x - max) / E over x = candidates / temperature, E its
    token's exponential variate, for (R, W) bf16 or float32 candidates (-inf where masked out), (R, 3) int64 words,
    (1 or R, W) int64 token ids (None: the column is the token id) and (R,) or (R, 1) float32 temperatures (None:
    x = candidates); None where the kernel does not apply (random_draws.race's torch path)."""
    if (candidates.device.type != "cpu" or candidates.dtype not in _DTYPES or candidates.dim() != 2
            or words.device.type != "cpu" or words.dtype != torch.int64
            or (ids is not None and (ids.device.type != "cpu" or ids.dtype != torch.int64))
            or (temperature is not None and (temperature.device.type != "cpu" or temperature.dtype != torch.float32))
            or (library := load()) is None):
        return None
    rows, width = candidates.shape
    out = torch.zeros(rows, dtype=torch.int64)
    if not rows or not width:
        return out
    if candidates.stride(1) != 1:
        candidates = candidates.contiguous()
    words = words.contiguous()
    ids_pointer, ids_row_stride = None, 0
    if ids is not None:
        if ids.stride(1) != 1:
            ids = ids.contiguous()
        ids_pointer, ids_row_stride = ids.data_ptr(), ids.stride(0) if ids.shape[0] > 1 else 0
    if temperature is not None:
        temperature = temperature.reshape(rows).contiguous()
    library.race_rows(candidates.data_ptr(), _DTYPES[candidates.dtype], candidates.stride(0),
                      None if temperature is None else temperature.data_ptr(), words.data_ptr(), ids_pointer,
                      ids_row_stride, rows, width, out.data_ptr())
    return out
