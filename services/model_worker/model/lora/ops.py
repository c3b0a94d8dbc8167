"""y += x A^T B^T per row group, by the device's kernel: C on CPU, Triton on CUDA, torch elsewhere."""
from __future__ import annotations

import torch

from services.model_worker.kernels import cpu_lora
from services.model_worker.model.lora.batch import LoraBatch


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part_ends: list[int],
             batch: LoraBatch) -> torch.Tensor:
    """y (T, out) with each adapter row's LoRA product added (in place where y is contiguous); x (T, in); a, b
    and part_ends a layer's slots (LoraSlots)."""
    if not y.is_contiguous():
        y = y.contiguous()
    x = x.contiguous()
    if x.device.type == "cpu" and x.dtype in cpu_lora.DTYPES and (library := cpu_lora.load()) is not None:
        cpu_lora.sgmv(library, y, x, a, b, part_ends, batch)
    elif x.device.type == "cuda":
        from services.model_worker.kernels import triton_lora

        triton_lora.sgmv(y, x, a, b, part_ends, batch)
    else:
        sgmv_reference(y, x, a, b, part_ends, batch)
    return y


def sgmv_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, part_ends: list[int],
                   batch: LoraBatch) -> None:
    """The SGMV in plain torch, where no kernel runs: per segment and part, a shrink and an expand.

    a: (slots, parts x R, in); b: (slots, R, out), B transposed; only each slot's first `rank` of R read;
    float32 sums, y rounded once.
    """
    width = b.shape[1]
    starts = batch.starts.tolist()
    for i, (slot, rank) in enumerate(zip(batch.slots.tolist(), batch.ranks.tolist())):
        rows = batch.rows[starts[i]:starts[i + 1]].to(y.device)
        added = torch.empty(rows.numel(), y.shape[1], dtype=torch.float32, device=y.device)
        begin = 0
        for p, end in enumerate(part_ends):
            shrunk = x.index_select(0, rows).float() @ a[slot, p * width:p * width + rank].float().t()  # (n, rank)
            added[:, begin:end] = shrunk @ b[slot, :rank, begin:end].float()
            begin = end
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + added).to(y.dtype))
