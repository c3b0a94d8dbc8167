"""Reading a checkpoint tensor into a parameter: whole, or the slice this tensor-parallel rank holds."""
from __future__ import annotations

from typing import Protocol

import torch

from services.model_worker.distributed.parallel import TensorParallel


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape does not fit the parameter the config gives it."""


class CheckpointTensor(Protocol):
    """A tensor in a safetensors file, read only where indexed (safetensors' get_slice)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index) -> torch.Tensor: ...


def read_whole(source: CheckpointTensor, dest: torch.Tensor) -> torch.Tensor:
    """All of source, which must have dest's shape."""
    return split_rows(source, dest, None, TensorParallel())


def split_rows(source: CheckpointTensor, dest: torch.Tensor, dim: int | None, tp: TensorParallel) -> torch.Tensor:
    """This rank's part of source along dim (None: all of it), read alone from the file.

    dest is what the part fills: the checkpoint tensor must be dest's shape with dim tp.size times as long.
    """
    shape = list(source.get_shape())
    want = list(dest.shape)
    if dim is not None:
        want[dim] *= tp.size
    if shape != want:
        raise WeightShapeError(f"checkpoint {shape}, config expects {want}")
    index = [slice(None)] * len(shape)
    if dim is not None:
        rows = dest.shape[dim]
        index[dim] = slice(tp.rank * rows, (tp.rank + 1) * rows)
    return source[tuple(index)]
