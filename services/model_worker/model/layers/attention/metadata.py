"""What every layer's attention reads about a step: where its tokens go in the paged cache, what each may attend to.

The runner describes a step once, as a few tensors (AttentionMetadata), and every layer's
attention reads them: no per-sequence Python inside the forward, and a fixed number of kernel
calls per layer whatever the batch size.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.model_worker.model.layers.attention.backend import AttentionBackend, cache_slots
from services.model_worker.model.layers.attention.dispatch import default_backend


@dataclass
class FlatLayout:
    """Where a step's new tokens sit: the tensors the attention metadata is made of.

    The flat batch holds T new tokens from B sequences, sequence b's tokens contiguous.
    """

    positions: torch.Tensor        # (T,) int64
    slot_mapping: torch.Tensor     # (T,) int64: cache slot each new token's key and value go to
    query_start_loc: torch.Tensor  # (B + 1,) int32: cu_seqlens of the new tokens
    context_lens: torch.Tensor     # (B,) int32: tokens in each sequence's context after this step
    block_tables: torch.Tensor     # (B, W) int32, padded with block 0
    max_query_len: int
    max_context_len: int

    @classmethod
    def build(cls, query_lens: list[int], block_tables: list[list[int]], context_lens: list[int],
              block_size: int) -> FlatLayout:
        """query_lens: each sequence's new tokens; context_lens: its tokens after this step (cached + new)."""
        used = [-(-n // block_size) for n in context_lens]  # a table may hold blocks past its context
        width = max(used)
        table = torch.tensor([blocks[:n] + [0] * (width - n) for blocks, n in zip(block_tables, used)],
                             dtype=torch.int32)
        context = torch.tensor(context_lens, dtype=torch.int32)
        q_lens = torch.tensor(query_lens, dtype=torch.int32)
        query_start = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start[1:])
        # Each new token's position, then its slot through its sequence's block table.
        rows = torch.arange(int(query_start[-1]), dtype=torch.int32)
        seq_of_row = torch.searchsorted(query_start[1:], rows, right=True)  # repeat_interleave is far slower
        positions = (context - q_lens)[seq_of_row] + rows - query_start[seq_of_row]
        slots = table[seq_of_row, positions // block_size].long() * block_size + positions % block_size
        return cls(positions.long(), slots, query_start, context, table, max(query_lens), max(context_lens))

    def to(self, device: torch.device) -> FlatLayout:
        return replace(self, **{name: getattr(self, name).to(device) for name in
                                ("positions", "slot_mapping", "query_start_loc", "context_lens", "block_tables")})


@dataclass
class PrefillLayout:
    """The sequences with more than one new token, padded to (P, Lq) queries against (P, Lk) keys.

    One SDPA call computes them all. Padding rows and keys are masked; padding query rows attend
    to key 0 only, so they stay finite and are dropped from the output.
    """

    query_rows: torch.Tensor        # (P, Lq) row of q for each padded query (padding repeats a real row)
    key_slots: torch.Tensor | None  # (P * Lk,) cache slot of each padded key; None: keys are this step's own
    mask: torch.Tensor | None       # (P, 1, Lq, Lk) True where a query may attend; None: plain causal
    out_rows: torch.Tensor          # (Tp,) padded query index (p * Lq + i) of each real prefill row, in batch order
    rows: torch.Tensor              # (Tp,) their rows in the flat batch
    # One sequence: the first of its rows, which run on unpadded through the batch. Its queries,
    # keys and output are then views, not gathered copies (5% of a 128-token prefill's time).
    single_start: int | None = None

    @classmethod
    def build(cls, query_start: torch.Tensor, q_lens: torch.Tensor, context: torch.Tensor, table: torch.Tensor,
              block_size: int) -> "PrefillLayout | None":
        seqs = torch.nonzero(q_lens > 1).flatten()
        if seqs.numel() == 0:
            return None
        q_lens, context, starts = q_lens[seqs], context[seqs], query_start[seqs]
        max_q, max_k = int(q_lens.max()), int(context.max())
        i = torch.arange(max_q)
        valid = i[None, :] < q_lens[:, None]                                   # (P, Lq)
        query_rows = starts[:, None] + torch.minimum(i[None, :], q_lens[:, None] - 1)
        out_rows = torch.nonzero(valid.flatten()).flatten()
        rows = query_rows.flatten()[out_rows]
        fresh = bool((context == q_lens).all())  # nothing cached: the keys are this step's own tokens
        single_start = int(starts[0]) if seqs.numel() == 1 else None
        if fresh and seqs.numel() == 1:
            return cls(query_rows, None, None, out_rows, rows, single_start)
        j = torch.arange(max_k)
        query_pos = (context - q_lens)[:, None] + i[None, :]                   # (P, Lq)
        mask = (j[None, None, :] <= query_pos[:, :, None]) & valid[:, :, None]
        mask[:, :, 0] = True  # padding queries see key 0: finite, and discarded
        key_slots = None if fresh else cache_slots(table[seqs], max_k, block_size).flatten()
        return cls(query_rows, key_slots, mask[:, None], out_rows, rows, single_start)

    def to(self, device: torch.device) -> "PrefillLayout":
        return PrefillLayout(*(None if t is None else t.to(device, non_blocking=True) for t in (
            self.query_rows, self.key_slots, self.mask, self.out_rows, self.rows)), self.single_start)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one may attend to.

    The flat batch holds T tokens from B sequences, sequence b's tokens contiguous. Built once
    per step by the runner, on the CPU, and moved to the device in one go; every layer shares it.
    The first four fields are the layout varlen and paged kernels take.
    """

    slot_mapping: torch.Tensor     # (T,) int64: cache slot written by each new token
    query_start_loc: torch.Tensor  # (B + 1,) int32: cu_seqlens of the queries
    context_lens: torch.Tensor     # (B,) int32: tokens in each sequence's context after this step
    block_tables: torch.Tensor     # (B, max_blocks) int32, padded with block 0
    block_size: int
    max_query_len: int
    max_context_len: int
    backend: AttentionBackend
    # Mixed steps only (max_query_len > 1): the one-token sequences, and the layout of the others.
    decode_seqs: torch.Tensor | None = None      # (Bd,) their batch indices
    decode_rows: torch.Tensor | None = None      # (Bd,) their rows in the flat batch
    prefill: PrefillLayout | None = None

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device, backend: AttentionBackend | None = None
              ) -> AttentionMetadata:
        """context_lens count each sequence's tokens after this step (cached + new)."""
        host = FlatLayout.build(query_lens, block_tables, context_lens, block_size)
        return cls.from_inputs(host.to(device), host, block_size, backend or default_backend(device))

    @classmethod
    def from_inputs(cls, inputs, host, block_size: int, backend: AttentionBackend) -> AttentionMetadata:
        """inputs: the step's tensors on the device; host: the same on the CPU, for the mixed-step layout.

        Either a FlatLayout or anything with its fields (the runner's StepInputs).
        """
        mixed = {}
        if host.max_query_len > 1 and not backend.whole_step:
            device = inputs.slot_mapping.device
            q_lens = host.query_start_loc.diff()
            decode_seqs = torch.nonzero(q_lens == 1).flatten()
            prefill = PrefillLayout.build(host.query_start_loc, q_lens, host.context_lens, host.block_tables,
                                          block_size)
            mixed = dict(decode_seqs=decode_seqs.to(device),
                         decode_rows=host.query_start_loc[decode_seqs].long().to(device), prefill=prefill.to(device))
        return cls(inputs.slot_mapping, inputs.query_start_loc, inputs.context_lens, inputs.block_tables, block_size,
                   host.max_query_len, host.max_context_len, backend, **mixed)
