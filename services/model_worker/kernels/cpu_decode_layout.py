"""A decode step's block tables, positions and cache slots from the persistent tables in one C call
(decode_layout.c), with None where the kernel cannot be built (the caller then takes the torch ops)."""
from __future__ import annotations

import ctypes
import functools
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("decode_layout.c")


@functools.cache
def load() -> ctypes.CDLL | None:
    library = build.load(SOURCE, "decode layout")
    if library is not None:
        library.decode_layout.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        library.decode_layout.restype = ctypes.c_int
    return library


def decode_layout(rows: torch.Tensor, seq_slots: list[int], context_lens: list[int], width: int, block_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(table (B, width) int32, positions (B,) int64, slot_mapping (B,) int64, context_lens (B,) int32) for a decode
    step of the sequences in rows `seq_slots` of `rows` ((N, W) int32, contiguous, on the CPU); None without the
    kernel. Raises IndexError for a row, context or block id the tables do not hold."""
    library = load()
    if library is None:
        return None
    count = len(seq_slots)
    slots = torch.tensor(seq_slots, dtype=torch.int64)
    context = torch.tensor(context_lens, dtype=torch.int32)
    table = torch.empty(count, width, dtype=torch.int32)
    positions = torch.empty(count, dtype=torch.int64)
    slot_mapping = torch.empty(count, dtype=torch.int64)
    status = library.decode_layout(rows.data_ptr(), rows.shape[0], rows.shape[1], slots.data_ptr(),
                                   context.data_ptr(), count, width, block_size, table.data_ptr(),
                                   positions.data_ptr(), slot_mapping.data_ptr())
    if status != 0:
        raise IndexError(f"decode layout: status {status} for {count} sequences in {rows.shape[0]} table rows of "
                         f"{rows.shape[1]} blocks, {width} wide (-1: a row outside them, -2: a context they do not "
                         f"hold, -3: a negative block id)")
    return table, positions, slot_mapping, context
