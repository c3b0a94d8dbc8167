"""What every layer's attention reads about a step: where its tokens go in the paged cache, what each may attend to.

The runner describes a step once, as a few tensors (AttentionMetadata), and every layer's
attention reads them: no per-sequence Python inside the forward, and a fixed number of kernel
calls per layer whatever the batch size.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.model_worker.model.layers.attention.backend import AttentionBackend
from services.model_worker.model.layers.attention.device_backend import default_backend
from services.model_worker.model.layers.attention.layout import PrefillLayout


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
    def build(cls, query_lens: list[int], block_tables: list[list[int]] | torch.Tensor, context_lens: list[int],
              block_size: int) -> FlatLayout:
        """query_lens: each sequence's new tokens; context_lens: its tokens after this step (cached + new).

        block_tables: per sequence its block ids, as lists or as the rows of an int32 tensor (entries past a
        sequence's context are never read)."""
        width = -(-max(context_lens) // block_size)
        if isinstance(block_tables, torch.Tensor):
            table = block_tables[:, :width].contiguous()
        else:
            used = [-(-n // block_size) for n in context_lens]  # a table may hold blocks past its context
            table = torch.tensor([blocks[:n] + [0] * (width - n) for blocks, n in zip(block_tables, used)],
                                 dtype=torch.int32)
        context = torch.tensor(context_lens, dtype=torch.int32)
        max_query_len = max(query_lens)
        if max_query_len == 1:  # a decode step: row b is sequence b's newest token
            query_start = torch.arange(len(query_lens) + 1, dtype=torch.int32)
            positions = (context - 1).long()
            slots = table.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1).long() * block_size \
                + positions % block_size
            return cls(positions, slots, query_start, context, table, 1, max(context_lens))
        q_lens = torch.tensor(query_lens, dtype=torch.int32)
        query_start = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(q_lens, 0, out=query_start[1:])
        # Each new token's position, then its slot through its sequence's block table.
        rows = torch.arange(int(query_start[-1]), dtype=torch.int32)
        seq_of_row = torch.searchsorted(query_start[1:], rows, right=True)  # repeat_interleave is far slower
        positions = (context - q_lens)[seq_of_row] + rows - query_start[seq_of_row]
        slots = table[seq_of_row, positions // block_size].long() * block_size + positions % block_size
        return cls(positions.long(), slots, query_start, context, table, max_query_len, max(context_lens))

    def to(self, device: torch.device) -> FlatLayout:
        return replace(self, **{name: getattr(self, name).to(device) for name in
                                ("positions", "slot_mapping", "query_start_loc", "context_lens", "block_tables")})


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
    # Steps with prompts: the rows whose final hidden states the step reads (ascending, int64), where they are
    # fewer than its rows; the model may leave the others undefined. None: every row is read.
    output_rows: torch.Tensor | None = None

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
                   host.max_query_len, host.max_context_len, backend, **mixed,
                   output_rows=_output_rows(host, inputs.slot_mapping.device))


def _output_rows(host, device: torch.device) -> torch.Tensor | None:
    """The rows a step with prompts reads the final hidden states of (its sample_rows, each once, ascending), where
    they are fewer than its rows: a prompt's rows before its last are there for their keys and values alone. None
    for a decode step, or where the layout says nothing of the rows it reads (a FlatLayout)."""
    sample_rows = getattr(host, "sample_rows", None)
    if host.max_query_len <= 1 or sample_rows is None:
        return None
    rows = torch.unique(sample_rows)  # sorted
    return rows.to(device) if rows.numel() < host.slot_mapping.numel() else None
