"""Every running sequence's block table as one row of a persistent tensor, so a step's tables are one gather.

A step used to turn each sequence's table (a Python list) into a padded row of a new tensor: work in
the table's length, for every sequence, every step. Here a sequence holds a row (its slot) from
admission until it stops running, and a row is written only where the table changed: a sequence
gains a block every block_size tokens. Entries past a row's blocks are stale and never read: a
step's kernels stop at each sequence's context length.

Writes wait until the rows are next read, and then go in together: at 256 sequences about 16 cross a
block boundary each step, and one tensor write apiece took about a tenth of a millisecond a step.
"""
from __future__ import annotations

import torch


class BlockTables:
    def __init__(self, max_seqs: int, max_blocks_per_seq: int, block_size: int):
        self.block_size = block_size
        self._rows = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32)
        self._free = list(range(max_seqs - 1, -1, -1))  # popped from the end: slot 0 first
        # (slot, column) -> block id, written since the rows were last read; a later write to a place wins.
        self._pending: dict[tuple[int, int], int] = {}

    @property
    def rows(self) -> torch.Tensor:
        """The (max_seqs, max_blocks_per_seq) int32 rows, every write so far in them."""
        if self._pending:
            self._flush()
        return self._rows

    @property
    def width(self) -> int:
        return self._rows.shape[1]

    def gather(self, slots: list[int], max_context: int) -> torch.Tensor:
        """The rows of these slots, as wide as the longest context needs: a row is as wide as the longest allowed."""
        width = -(-max_context // self.block_size)
        return self.rows[:, :width].index_select(0, torch.tensor(slots, dtype=torch.int64))

    def assign(self, seq) -> None:
        seq.slot = self._free.pop()
        seq.slot_blocks = 0

    def release(self, seq) -> None:
        if seq.slot >= 0:
            self._free.append(seq.slot)
            seq.slot = -1

    def write(self, seq) -> None:
        """Copies the blocks the sequence's row does not have yet (a table only grows at its end, or shrinks)."""
        table, done = seq.block_table, seq.slot_blocks
        if len(table) > done:
            if len(table) > self.width:
                raise ValueError(f"a block table of {len(table)} blocks is wider than the {self.width} a row holds")
            slot, pending = seq.slot, self._pending
            for column in range(done, len(table)):
                pending[slot, column] = table[column]
        seq.slot_blocks = len(table)

    def _flush(self) -> None:
        """The pending writes as one indexed write (each place once, so the order of writes cannot matter)."""
        places, self._pending = self._pending, {}
        slots, columns = zip(*places)
        self._rows.index_put_((torch.tensor(slots, dtype=torch.int64), torch.tensor(columns, dtype=torch.int64)),
                              torch.tensor(list(places.values()), dtype=torch.int32))
