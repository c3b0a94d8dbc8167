"""Where a step's prompt rows and cached keys sit: the slot arithmetic and prefill layout that backends read.

Below both the backends and the step's metadata, so that each can name these types without
importing the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def cache_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """(N, length) cache slots of positions 0..length-1 of each sequence (past a table's end: its last block)."""
    j = torch.arange(length, device=block_tables.device)
    blocks = torch.clamp(j // block_size, max=block_tables.shape[1] - 1)
    return block_tables.long()[:, blocks] * block_size + j % block_size


@dataclass
class PrefillLayout:
    """The sequences with more than one new token, each attended over its own rows: no padding.

    A step of several prompts used to be padded to its longest one, under a dense boolean mask:
    every prompt cost as much as the longest, and the mask kept SDPA from skipping the blocks
    above the diagonal. 16 prompts of 32-512 tokens spent about half their prefill time there.
    Each prompt is now one SDPA call on its own rows (views of the flat batch, no copies): a
    fresh prompt is plain causal attention, exactly the call it gets when it prefills alone, so
    its result does not depend on its neighbours; one with cached tokens (a later chunk, a
    prefix-cache hit) reads its keys from the cache under its own (Lq, Lk) causal mask. A
    prompt's attention costs time in proportion to its tokens squared, so one call each costs
    nothing next to it (decodes stay one kernel call a step).
    """

    starts: list[int]                      # each sequence's first row in the flat batch
    lens: list[int]                        # its new tokens
    key_slots: list[torch.Tensor | None]   # (Lk,) cache slots of its keys; None: fresh, the keys are its own rows
    masks: list[torch.Tensor | None]       # (1, 1, Lq, Lk) True where a query may attend; None: plain causal
    rows: torch.Tensor                     # (Tp,) int64: all their rows in the flat batch, in batch order

    @property
    def single_start(self) -> int | None:
        """One prefilling sequence: its first row."""
        return self.starts[0] if len(self.starts) == 1 else None

    @classmethod
    def build(cls, query_start: torch.Tensor, q_lens: torch.Tensor, context: torch.Tensor, table: torch.Tensor,
              block_size: int) -> "PrefillLayout | None":
        seqs = torch.nonzero(q_lens > 1).flatten().tolist()
        if not seqs:
            return None
        starts, lens, key_slots, masks, rows = [], [], [], [], []
        for b in seqs:
            start, n, total = int(query_start[b]), int(q_lens[b]), int(context[b])
            starts.append(start)
            lens.append(n)
            rows.append(torch.arange(start, start + n))
            if total == n:  # nothing cached: the keys are this step's own tokens
                key_slots.append(None)
                masks.append(None)
                continue
            key_slots.append(cache_slots(table[b:b + 1], total, block_size).flatten())
            # Query i sits at position total - n + i and sees keys 0 .. that position.
            query_pos = torch.arange(total - n, total)
            masks.append((torch.arange(total)[None, :] <= query_pos[:, None])[None, None])
        return cls(starts, lens, key_slots, masks, torch.cat(rows))

    def to(self, device: torch.device) -> "PrefillLayout":
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)
        return PrefillLayout(self.starts, self.lens, [move(t) for t in self.key_slots], [move(t) for t in self.masks],
                             move(self.rows))
