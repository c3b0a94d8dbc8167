"""CPU tensors on memory the kernel may back with 2 MiB pages (transparent huge pages).

A decode step streams every weight once and reads the KV cache in scattered 4 KiB blocks; on
4 KiB pages each of those pages costs a TLB miss and a page walk. Measured on the project's
machine (THP in `madvise` mode, the common default): the 0.6B model's linears streamed in 51 ms
on huge pages against 57 ms on small ones (one row; 67 against 72 ms at 16 rows), and 28 layers
of decode attention at context 2048 in 16.4 against 18.3 ms (whole decode steps moved less, within
the machine's noise: docs/served-speed.md, item 10). Where the kernel has no THP, or it is off,
the same calls give ordinary pages.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch
from torch import nn

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor starts on its own page


def empty(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory as a uint8 tensor, starting on a 2 MiB boundary, advised for huge pages."""
    # Anonymous memory is zero until written (the KV cache relies on that) and is only backed by
    # huge pages where a 2 MiB-aligned stretch of it is: map a page more and start at a boundary.
    # Private: a shared mapping is shmem, whose huge pages follow another setting (usually off).
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as e:  # not Linux, or a kernel built without THP
        log.debug("no huge pages for this memory: %s", e)
    whole = torch.frombuffer(buffer, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def tensors(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed tensors of these (shape, dtype), side by side in one huge-page mapping."""
    nbytes = [math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in specs]
    arena = empty(max(sum(_aligned(n) for n in nbytes), 1))
    out, offset = [], 0
    for (shape, dtype), n in zip(specs, nbytes):
        out.append(arena[offset:offset + n].view(dtype).view(shape))
        offset += _aligned(n)
    return out


def move_parameters(model: nn.Module) -> None:
    """Re-home every parameter of a CPU model (contents not kept) on huge pages.

    For a model fresh from to_empty(), before its weights are read in: the copies then land on
    the new memory, and the old allocations are freed untouched.
    """
    params = [p for p in model.parameters() if p.device.type == "cpu"]  # parameters() skips tied repeats
    for param, home in zip(params, tensors([(tuple(p.shape), p.dtype) for p in params])):
        param.data = home


def rehome_parameters(model: nn.Module) -> None:
    """Copy every CPU parameter of a loaded model into one fresh huge-page mapping.

    For a load whose layers replaced some parameters once they were in (8-bit weights quantized on
    load): the mapping move_parameters made holds them all, so it stays resident, old weights and
    all, while any one of its tensors lives; after this nothing refers to it and it is unmapped.
    """
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    for param, home in zip(params, tensors([(tuple(p.shape), p.dtype) for p in params])):
        home.copy_(param.data)
        param.data = home


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
