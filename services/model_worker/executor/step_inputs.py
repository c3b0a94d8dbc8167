"""A step's inputs as a handful of integer tensors, built on the host and sent up in one copy.

Built from the scheduled sequences with no per-token Python beyond collecting the new token ids.
A pure decode step can be padded to a captured CUDA graph's batch size (see cuda_graphs.py):
padding rows are one-token sequences that read and write only a spare cache block, so the real
rows' results do not change.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from services.model_worker.executor.transfer import upload_all
from services.model_worker.kernels.cpu_decode_layout import decode_layout
from services.model_worker.model.layers.attention.metadata import FlatLayout

TENSOR_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens", "block_tables",
                 "sample_rows")


@dataclass
class StepInputs:
    input_ids: torch.Tensor        # (T,) int64, the new tokens, sequence by sequence
    positions: torch.Tensor        # (T,) int64
    slot_mapping: torch.Tensor     # (T,) int64: cache slot each new token's key and value go to
    query_start_loc: torch.Tensor  # (B + 1,) int32: cu_seqlens of the new tokens
    context_lens: torch.Tensor     # (B,) int32: tokens in each sequence's context after this step
    block_tables: torch.Tensor     # (B, W) int32, padded with block 0
    # (S + E,) int64: rows whose logits are wanted: the S whose next token is sampled (a prompt's last
    # chunk, decodes), then E prompt rows whose logits score the prompt (prompt logprobs)
    sample_rows: torch.Tensor
    max_query_len: int
    max_context_len: int
    # Asynchronous scheduling: input_ids rows that hold placeholders for tokens the previous step sampled, and
    # those tokens' rows in its sampled ids; the runner copies them in on the device. None: every id is here.
    fill_rows: torch.Tensor | None = None
    fill_from: torch.Tensor | None = None
    # (T,) int64 on the host: each row's LoRA adapter slot, -1 for the base model; None: no row has an adapter.
    lora_slots: torch.Tensor | None = None
    # The last this many sample_rows are pooled prompts' last rows whose final hidden states are wanted, not logits.
    num_hidden_rows: int = 0

    @classmethod
    def build(cls, token_ids: list[list[int]], block_tables: list[list[int]], context_lens: list[int],
              block_size: int, sampled: list[int] | None = None, extra_rows: list[int] = (),
              num_draft: list[int] | None = None) -> "StepInputs":
        """token_ids: each sequence's new tokens; context_lens: its tokens after this step (cached + new).

        sampled: the sequences whose last new token yields a next token (default: all).
        extra_rows: flat rows whose logits are wanted too, after the sampled ones (prompt logprobs).
        num_draft: per sampled sequence, how many of its last new tokens are proposals to verify: its
        d + 1 last rows are sampled, in order (speculative decoding); None: none anywhere.
        """
        flat = FlatLayout.build([len(t) for t in token_ids], block_tables, context_lens, block_size)
        last_rows = flat.query_start_loc[1:].long() - 1
        sample_rows = last_rows if sampled is None else last_rows[torch.tensor(sampled, dtype=torch.int64)]
        if num_draft is not None and any(num_draft):
            counts = torch.tensor(num_draft, dtype=torch.int64) + 1
            ends = sample_rows.repeat_interleave(counts)
            back = counts.cumsum(0).repeat_interleave(counts) - torch.arange(int(counts.sum())) - 1
            sample_rows = ends - back
        if extra_rows:
            sample_rows = torch.cat((sample_rows, torch.tensor(extra_rows, dtype=torch.int64)))
        return cls(torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64), flat.positions,
                   flat.slot_mapping, flat.query_start_loc, flat.context_lens, flat.block_tables, sample_rows,
                   flat.max_query_len, flat.max_context_len)

    @classmethod
    def decode(cls, token_ids: list[int], block_tables: torch.Tensor, context_lens: list[int],
               block_size: int) -> "StepInputs":
        """A decode step: one new token per sequence, each sampled; block_tables has a row per sequence."""
        return cls._decode_step(token_ids, FlatLayout.build([1] * len(token_ids), block_tables, context_lens,
                                                            block_size))

    @classmethod
    def decode_from_tables(cls, token_ids: list[int], tables, seq_slots: list[int],
                           context_lens: list[int]) -> "StepInputs":
        """decode() for the sequences in rows `seq_slots` of `tables` (the persistent BlockTables), its layout
        built in one C pass where the kernel is available (the same values)."""
        max_context, block_size = max(context_lens), tables.block_size
        layout = decode_layout(tables.rows, seq_slots, context_lens, -(-max_context // block_size), block_size)
        if layout is None:
            return cls.decode(token_ids, tables.gather(seq_slots, max_context), context_lens, block_size)
        table, positions, slot_mapping, context = layout
        query_start = torch.arange(len(token_ids) + 1, dtype=torch.int32)
        return cls._decode_step(token_ids, FlatLayout(positions, slot_mapping, query_start, context, table, 1,
                                                      max_context))

    @classmethod
    def _decode_step(cls, token_ids: list[int], flat: FlatLayout) -> "StepInputs":
        """A decode step's inputs on its layout: every row sampled, in order."""
        return cls(torch.tensor(token_ids, dtype=torch.int64), flat.positions, flat.slot_mapping,
                   flat.query_start_loc, flat.context_lens, flat.block_tables,
                   torch.arange(len(token_ids), dtype=torch.int64), 1, flat.max_context_len)

    def filled_from_previous(self, rows: list[int], sources: list[int]) -> "StepInputs":
        """These inputs with input_ids rows `rows` to be copied from the previous step's sampled ids at
        `sources`, on the device (asynchronous scheduling); unchanged when there are none."""
        if rows:
            self.fill_rows = torch.tensor(rows, dtype=torch.int64)
            self.fill_from = torch.tensor(sources, dtype=torch.int64)
        return self

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def to(self, device: torch.device) -> "StepInputs":
        """On the device, all tensors in one (pinned, non-blocking) copy."""
        names = TENSOR_FIELDS + (("fill_rows", "fill_from") if self.fill_rows is not None else ())
        moved = upload_all([getattr(self, name) for name in names], device)
        return replace(self, **dict(zip(names, moved)))

    def padded(self, num_seqs: int, table_width: int, pad_block: int, block_size: int) -> "StepInputs":
        """A decode step (one token per sequence) padded to num_seqs sequences and table_width blocks.

        Padding sequences hold one token at position 0 in pad_block, a block no sequence owns.
        """
        assert self.max_query_len == 1 and num_seqs >= self.num_seqs and table_width >= self.block_tables.shape[1]
        extra = num_seqs - self.num_seqs
        table = torch.full((num_seqs, table_width), pad_block, dtype=torch.int32)
        table[:self.num_seqs, :self.block_tables.shape[1]] = self.block_tables
        return replace(
            self,
            input_ids=torch.cat((self.input_ids, torch.zeros(extra, dtype=torch.int64))),
            positions=torch.cat((self.positions, torch.zeros(extra, dtype=torch.int64))),
            slot_mapping=torch.cat((self.slot_mapping, torch.full((extra,), pad_block * block_size))),
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
            context_lens=torch.cat((self.context_lens, torch.ones(extra, dtype=torch.int32))),
            block_tables=table,
        )

