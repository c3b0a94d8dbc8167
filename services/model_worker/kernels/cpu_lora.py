"""The LoRA SGMV C kernel (lora.c), called through ctypes on CPU tensors of float32 or bf16."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("lora.c")
DTYPES = (torch.float32, torch.bfloat16)
_library: list = []  # [the library or None], once built
_ends: dict[tuple[int, ...], torch.Tensor] = {}  # part ends as the kernel reads them, made once per layout


def load() -> ctypes.CDLL | None:
    """The compiled kernel, built once per process; None where no C compiler builds it."""
    if not _library:
        library = build.load(SOURCE, "LoRA")
        if library is not None:
            library.lora_sgmv.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_void_p] * 4
                                          + [ctypes.c_int64] * 5 + [ctypes.c_void_p])
            library.lora_sgmv.restype = ctypes.c_int
        _library.append(library)
    return _library[0]


def sgmv(library: ctypes.CDLL, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
         part_ends: list[int], batch) -> None:
    """y (T, out) += each segment's x A^T B^T, in place; all four contiguous, of one dtype in DTYPES.

    a: (slots, parts x R, in); b: (slots, R, out), B transposed; batch: a LoraBatch on the host."""
    assert x.dtype == y.dtype == a.dtype == b.dtype and x.is_contiguous() and y.is_contiguous()
    key = tuple(part_ends)
    ends = _ends.get(key)
    if ends is None:
        ends = _ends[key] = torch.tensor(part_ends, dtype=torch.int64)
    status = library.lora_sgmv(y.data_ptr(), x.data_ptr(), a.data_ptr(), b.data_ptr(), int(x.dtype == torch.bfloat16),
                               batch.rows.data_ptr(), batch.starts.data_ptr(), batch.slots.data_ptr(),
                               batch.ranks.data_ptr(), batch.num_segments, x.shape[1], y.shape[1], b.shape[1],
                               len(part_ends), ends.data_ptr())
    if status != 0:
        raise MemoryError("the LoRA kernel could not allocate its scratch rows")
