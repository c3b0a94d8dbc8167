"""Each targeted linear layer's adapter slots, preallocated at the largest rank, and the model-wide step state.

A fused layer (q/k/v, gate/up) holds one part per projection: A stacks the parts' A matrices
(parts x R rows), B keeps each output's own R values, and the expand reads an output's part of the
shrink. So a fused layer costs one shrink and one expand per row group, with no zero blocks in B. B is
stored transposed, (R, out), so the expand runs along contiguous outputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.model_worker.model.lora.batch import LoraBatch
from services.model_worker.model.lora.ops import add_lora
from services.model_worker.model.lora.peft_folder import PeftAdapter

if TYPE_CHECKING:
    from services.model_worker.model.layers.linear import LinearBase


class LoraState:
    """What every slot layer of one model reads during a step: the rows grouped by slot (None: no adapter rows)."""

    def __init__(self, max_loras: int, max_rank: int):
        self.max_loras, self.max_rank = max_loras, max_rank
        self.ranks = torch.zeros(max_loras, dtype=torch.int64)  # each slot's rank (0: empty)
        self.batch: LoraBatch | None = None

    @property
    def active(self) -> bool:
        return self.batch is not None


class LoraSlots:
    """One linear layer's adapter slots: A (slots, parts x R, in), B^T (slots, R, out), scaling folded into B."""

    def __init__(self, layer: "LinearBase", parts: list[tuple[str, slice]], state: LoraState,
                 dtype: torch.dtype, device: torch.device, split_input: bool = False):
        """parts: each projection's outputs on this rank; split_input: the layer is row-parallel, so this rank
        holds its slice of A's inputs and B whole (else A whole and its slice of each part's B outputs)."""
        self.state = state
        self.tp_rank = layer.tp.rank
        self.split_input = split_input
        self.modules = [name for name, _ in parts]
        self.slices = [s for _, s in parts]
        rank = state.max_rank
        self.a = torch.zeros(state.max_loras, len(parts) * rank, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(state.max_loras, rank, layer.out_features, dtype=dtype, device=device)
        # Each part's end in the outputs: the parts tile the outputs in order.
        assert [s.start for s in self.slices] == [0] + [s.stop for s in self.slices[:-1]]
        assert self.slices[-1].stop == layer.out_features
        self.part_ends = [s.stop for s in self.slices]

    def add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y, the layer's output for x, with this step's adapter rows' products added; y itself in a step
        without adapter rows. The layer calls it (model/layers/ knows nothing of adapters beyond this)."""
        batch = self.state.batch
        if batch is None:
            return y
        return add_lora(y, x, self.a, self.b, self.part_ends, batch)

    def write(self, slot: int, layer_index: int, adapter: PeftAdapter) -> None:
        rank, width = adapter.rank, self.state.max_rank
        self.clear(slot)
        for p, (module, rows) in enumerate(zip(self.modules, self.slices)):
            pair = adapter.weights.get((layer_index, module))
            if pair is None:
                continue  # not targeted: its part stays zero
            a, b = pair
            # Tensor parallelism: this rank's inputs of a row-parallel layer, its outputs of each column-parallel
            # part; the row-parallel layer's all-reduce then sums the ranks' partial products, exactly, as
            # (x_0 A_0^T + x_1 A_1^T) B^T = x_0 A_0^T B^T + x_1 A_1^T B^T.
            if self.split_input:
                inputs = self.a.shape[2]
                a = a[:, self.tp_rank * inputs:(self.tp_rank + 1) * inputs]
            else:
                outputs = rows.stop - rows.start
                b = b[self.tp_rank * outputs:(self.tp_rank + 1) * outputs]
            self.a[slot, p * width:p * width + rank] = a.to(self.a.dtype)
            self.b[slot, :rank, rows] = (b * adapter.scaling).t().to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
