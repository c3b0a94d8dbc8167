"""A step's rows grouped by adapter slot: the segments each shrink-and-expand pair works on (Punica's SGMV)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraBatch:
    """Rows with an adapter, sorted by slot, in segments of one slot each; base rows are in none.

    rows[starts[i]:starts[i + 1]] are the rows of segment i, whose adapter is in slot slots[i] with rank ranks[i].
    """

    rows: torch.Tensor    # (N,) int64: row indices, grouped by slot
    starts: torch.Tensor  # (S + 1,) int64
    slots: torch.Tensor   # (S,) int64
    ranks: torch.Tensor   # (S,) int64
    max_rows: int         # the longest segment

    @classmethod
    def build(cls, row_slots: torch.Tensor, slot_ranks: torch.Tensor) -> "LoraBatch | None":
        """row_slots: (T,) int64 on the host, each row's slot (-1: the base model); None when no row has one."""
        rows = torch.nonzero(row_slots >= 0).flatten()
        if not rows.numel():
            return None
        slots_of = row_slots[rows]
        order = torch.argsort(slots_of, stable=True)
        slots, counts = torch.unique_consecutive(slots_of[order], return_counts=True)
        starts = torch.zeros(slots.numel() + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts[1:])
        return cls(rows[order], starts, slots, slot_ranks[slots], int(counts.max()))

    def to(self, device: torch.device) -> "LoraBatch":
        if device.type == "cpu":
            return self
        return LoraBatch(*(t.to(device, non_blocking=True) for t in (self.rows, self.starts, self.slots, self.ranks)),
                         self.max_rows)

    @property
    def num_segments(self) -> int:
        return self.slots.numel()
