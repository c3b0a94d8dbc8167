"""Tensor parallelism: each step's inputs from rank 0 to the other ranks, which run the same forward."""
from __future__ import annotations

import torch
import torch.distributed as dist

from services.model_worker.executor.step_inputs import StepInputs

_STEP, _STOP = 1, 2
_HEADER = 8  # kind, tokens, seqs, table width, sampled rows, max query len, max context len, hidden rows


class StepChannel:
    """Each step's StepInputs from rank 0 to the others as one broadcast of one int32 buffer.

    The buffer is sized for the largest step the scheduler can make (tokens, sequences, block
    table width), so every step is a single broadcast of a known size.
    """

    def __init__(self, group, max_tokens: int, max_seqs: int, max_table_width: int):
        self.group = group
        # Sampled rows: at most one per token (speculative decoding samples every proposed row).
        capacity = _HEADER + 3 * max_tokens + (max_seqs + 1) + max_seqs + max_seqs * max_table_width + max_tokens
        self.buffer = torch.zeros(capacity, dtype=torch.int32)

    def send(self, host: StepInputs) -> None:
        parts = [host.input_ids, host.positions, host.slot_mapping, host.query_start_loc, host.context_lens,
                 host.block_tables.flatten(), host.sample_rows]
        sizes = [host.input_ids.numel(), host.num_seqs, host.block_tables.shape[1], host.sample_rows.numel(),
                 host.max_query_len, host.max_context_len, host.num_hidden_rows]
        end = _HEADER + sum(p.numel() for p in parts)
        if end > self.buffer.numel():
            raise ValueError(f"a step of {end} integers exceeds the step buffer of {self.buffer.numel()}")
        self.buffer[:_HEADER] = torch.tensor([_STEP, *sizes], dtype=torch.int32)
        torch.cat([p.to(torch.int32) for p in parts], out=self.buffer[_HEADER:end])
        dist.broadcast(self.buffer, src=0, group=self.group)

    def stop(self) -> None:
        self.buffer[0] = _STOP
        dist.broadcast(self.buffer, src=0, group=self.group)

    def receive(self) -> StepInputs | None:
        """The next step's inputs; None when rank 0 says stop."""
        dist.broadcast(self.buffer, src=0, group=self.group)
        kind, tokens, seqs, width, sampled, max_query_len, max_context_len, hidden_rows = self.buffer[:_HEADER].tolist()
        if kind == _STOP:
            return None
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, sampled]
        parts = self.buffer[_HEADER:_HEADER + sum(sizes)].split(sizes)
        return StepInputs(parts[0].long(), parts[1].long(), parts[2].long(), parts[3].clone(), parts[4].clone(),
                          parts[5].reshape(seqs, width).clone(), parts[6].long(), max_query_len, max_context_len,
                          num_hidden_rows=hidden_rows)
