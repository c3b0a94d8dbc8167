"""The token histories penalties read, as device rows: kept per slot for running sequences, or built from ids.

A repetition penalty reads the set of a row's prompt and output tokens, presence and frequency penalties
the counts of its output tokens (sampler.py). Building those from the ids every step is host work and
copies that grow with the sequence. PenaltyState instead keeps a running sequence's two rows at its slot
(BlockTables: held from admission until it stops running), builds them once when the sequence first samples
there, and adds each step's sampled ids on the device in one op, never reading them back: a token still in
flight (asynchronous scheduling) is counted before the next step samples. A token sampled for a sequence
that had already ended lands in a row nobody reads again: the next sequence in the slot rebuilds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import torch

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor.transfer import to_device


@dataclass
class PenaltyRows:
    """A batch's penalised rows and where their histories are: the j-th penalised row reads row slots[j] of
    seen and counts (the sampler gathers them, one op each)."""
    rows: torch.Tensor | None  # (R,) int64: the batch rows with penalties; None: every row, in order
    slots: torch.Tensor        # (R,) int64
    seen: torch.Tensor         # (S, V) bool: tokens in the prompt or the output
    counts: torch.Tensor       # (S, V) float32: times each token is in the output

    @classmethod
    def from_ids(cls, params: list[SamplingParams], prompt_ids: list, output_ids: list, vocab: int,
                 device: torch.device) -> PenaltyRows | None:
        """Built from each row's ids (lists, or 1-D integer tensors), for the rows whose params have
        penalties; None when none has."""
        rows = [i for i, p in enumerate(params) if p.has_penalties]
        if not rows:
            return None
        seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
        counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
        prompts, outputs = [prompt_ids[i] for i in rows], [output_ids[i] for i in rows]
        local = range(len(rows))
        prompt_rows, output_rows = _repeat(local, prompts), _repeat(local, outputs)
        index = to_device(prompt_rows + output_rows, torch.long, device)
        ids = _ids(prompts + outputs, device)
        _write(seen, counts, index, ids, index[len(prompt_rows):], ids[len(prompt_rows):])
        every = len(rows) == len(params)
        return cls(None if every else to_device(rows, torch.long, device),
                   torch.arange(len(rows), device=device), seen, counts)


def allocate_rows(max_seqs: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """PenaltyState's seen and counts rows, zeroed. On a GPU the KV cache is sized with them counted
    (kv_sizing.profile_step_memory allocates them the same way), although the state allocates them lazily."""
    return (torch.zeros(max_seqs, vocab, dtype=torch.bool, device=device),
            torch.zeros(max_seqs, vocab, dtype=torch.float32, device=device))


class PenaltyState:
    """Per slot, the seen and counts rows of the penalised sequence running there; allocated when a penalised
    sequence first samples (max_seqs x vocab x 5 bytes: 194 MB at 256 slots of Qwen3's vocabulary)."""

    def __init__(self, max_seqs: int, device: torch.device):
        self.max_seqs = max_seqs
        self.device = device
        self.seen: torch.Tensor | None = None    # (max_seqs, V) bool
        self.counts: torch.Tensor | None = None  # (max_seqs, V) float32
        # Per slot, whose rows it holds: (sequence, its preemption count), so a readmitted sequence rebuilds.
        self._owner: list[tuple[object, int] | None] = [None] * max_seqs
        # The last batch's layout (rows, slots, batch size) and its device tensors: a decode batch keeps them
        # step after step.
        self._layout: tuple[list[int], list[int], int] | None = None
        self._index: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def holds(self, seq) -> bool:
        """Whether the sequence's slot holds its rows (built for it since it last took the slot)."""
        owner = self._owner[seq.slot] if seq.slot >= 0 else None
        return owner is not None and owner[0] is seq and owner[1] == seq.num_preemptions

    def rows(self, seqs: list, vocab: int, pending_ids: torch.Tensor | None) -> PenaltyRows | None:
        """The penalised rows of a step that samples seqs (in row order), building the rows of sequences new
        to their slot; pending_ids: the sampled ids of the step in flight, where seq.pending_row points."""
        rows = [i for i, s in enumerate(seqs) if s.has_penalties]
        if not rows:
            return None
        if self.seen is None:
            self.seen, self.counts = allocate_rows(self.max_seqs, vocab, self.device)
        stale = [seqs[i] for i in rows if not self.holds(seqs[i])]
        if stale:
            self.rebuild(stale, pending_ids)
        layout = (rows, [seqs[i].slot for i in rows], len(seqs))
        if self._layout != layout:
            self._layout = layout
            index = to_device(rows + layout[1], torch.long, self.device)
            ones = torch.ones(len(rows), dtype=torch.float32, device=self.device)
            every = len(rows) == len(seqs)
            self._index = (None if every else index[:len(rows)], index[len(rows):], ones, ones.bool())
        row_index, slot_index, _, _ = self._index
        return PenaltyRows(row_index, slot_index, self.seen, self.counts)

    def record(self, token_ids: torch.Tensor) -> None:
        """Adds the sampled ids (B,) of the step rows() was last called for to its penalised rows' slots."""
        row_index, slot_index, ones, trues = self._index
        ids = token_ids if row_index is None else token_ids[row_index]
        self.counts.index_put_((slot_index, ids), ones, accumulate=True)
        self.seen.index_put_((slot_index, ids), trues)

    def forget(self, seqs: list) -> None:
        """The sequences took tokens this state did not record (speculative verification): their rows are
        rebuilt before they next sample."""
        for seq in seqs:
            if self.holds(seq):
                self._owner[seq.slot] = None

    def rebuild(self, seqs: list, pending_ids: torch.Tensor | None) -> None:
        """Writes the sequences' rows at their slots from their prompt and output ids, a token in flight
        included: one copy to the device and one scatter for them all."""
        slots = [s.slot for s in seqs]
        prompts, outputs = [s.prompt_ids for s in seqs], [s.output_ids for s in seqs]
        pending = [s for s in seqs if s.num_pending]
        # Per token: its slot, then its id (prompt tokens, output tokens, then the tokens in flight).
        token_slots = _repeat(slots, prompts) + _repeat(slots, outputs) + [s.slot for s in pending]
        known_ids = list(chain.from_iterable(prompts + outputs))
        flat = to_device(slots + token_slots + known_ids + [s.pending_row for s in pending], torch.long, self.device)
        slot_index, flat = flat[:len(slots)], flat[len(slots):]
        token_index, ids = flat[:len(token_slots)], flat[len(token_slots):]
        if pending:
            ids = torch.cat((ids[:len(known_ids)], pending_ids[ids[len(known_ids):]]))
        self.seen.index_fill_(0, slot_index, False)
        self.counts.index_fill_(0, slot_index, 0.0)
        outputs_from = sum(map(len, prompts))
        _write(self.seen, self.counts, token_index, ids, token_index[outputs_from:], ids[outputs_from:])
        for seq in seqs:
            self._owner[seq.slot] = (seq, seq.num_preemptions)


def _repeat(values, rows: list) -> list[int]:
    """Each value as many times as its row has ids."""
    return list(chain.from_iterable([v] * len(row) for v, row in zip(values, rows)))


def _ids(ids: list, device: torch.device) -> torch.Tensor:
    """Rows of ids (lists or tensors) as one flat int64 device tensor."""
    if any(isinstance(t, torch.Tensor) for t in ids):
        parts = [torch.as_tensor(t, dtype=torch.long).to(device) for t in ids]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=device)
    return to_device(list(chain.from_iterable(ids)), torch.long, device)


def _write(seen: torch.Tensor, counts: torch.Tensor, seen_rows: torch.Tensor, seen_ids: torch.Tensor,
           count_rows: torch.Tensor, count_ids: torch.Tensor) -> None:
    # Device tensors of ones, not Python numbers: index_put_ would copy a host scalar to the GPU, and wait.
    seen.index_put_((seen_rows, seen_ids), torch.ones_like(seen_ids, dtype=torch.bool))
    counts.index_put_((count_rows, count_ids), torch.ones_like(count_ids, dtype=torch.float32), accumulate=True)
