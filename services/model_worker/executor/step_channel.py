"""Tensor parallelism: each step's inputs and adapter changes from rank 0 to the other ranks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.model_worker.executor.step_inputs import StepInputs

_STEP, _STOP, _ADAPTER = 1, 2, 3
# kind, tokens, seqs, table width, sampled rows, max query len, max context len, hidden rows, adapter slot rows
_HEADER = 9


@dataclass
class AdapterChange:
    """Rank 0's adapter slot `slot` now holds the PEFT folder at `path`; None: it was cleared."""

    slot: int
    path: str | None


class StepChannel:
    """Each step's StepInputs (and each adapter slot's change) from rank 0 to the others as one broadcast of one
    int32 buffer.

    The buffer is sized for the largest step the scheduler can make (tokens, sequences, block
    table width), so every step is a single broadcast of a known size.
    """

    def __init__(self, group, max_tokens: int, max_seqs: int, max_table_width: int):
        self.group = group
        # Sampled rows: at most one per token (speculative decoding samples every proposed row).
        # The last max_tokens: each row's adapter slot, where a row has one.
        capacity = (_HEADER + 3 * max_tokens + (max_seqs + 1) + max_seqs + max_seqs * max_table_width + max_tokens
                    + max_tokens)
        self.buffer = torch.zeros(capacity, dtype=torch.int32)

    def send(self, host: StepInputs) -> None:
        parts = [host.input_ids, host.positions, host.slot_mapping, host.query_start_loc, host.context_lens,
                 host.block_tables.flatten(), host.sample_rows]
        if host.lora_slots is not None:
            parts.append(host.lora_slots)
        sizes = [host.input_ids.numel(), host.num_seqs, host.block_tables.shape[1], host.sample_rows.numel(),
                 host.max_query_len, host.max_context_len, host.num_hidden_rows,
                 0 if host.lora_slots is None else host.lora_slots.numel()]
        end = _HEADER + sum(p.numel() for p in parts)
        if end > self.buffer.numel():
            raise ValueError(f"a step of {end} integers exceeds the step buffer of {self.buffer.numel()}")
        self.buffer[:_HEADER] = torch.tensor([_STEP, *sizes], dtype=torch.int32)
        torch.cat([p.to(torch.int32) for p in parts], out=self.buffer[_HEADER:end])
        dist.broadcast(self.buffer, src=0, group=self.group)

    def send_adapter(self, slot: int, path: str | None) -> None:
        """Have the other ranks read the folder at `path` into adapter slot `slot` (None: clear it)."""
        encoded = torch.tensor(list(path.encode()) if path is not None else [], dtype=torch.int32)
        if _HEADER + encoded.numel() > self.buffer.numel():
            raise ValueError(f"an adapter path of {encoded.numel()} bytes exceeds the step buffer")
        self.buffer[:3] = torch.tensor([_ADAPTER, slot, -1 if path is None else encoded.numel()], dtype=torch.int32)
        self.buffer[_HEADER:_HEADER + encoded.numel()] = encoded
        dist.broadcast(self.buffer, src=0, group=self.group)

    def stop(self) -> None:
        self.buffer[0] = _STOP
        dist.broadcast(self.buffer, src=0, group=self.group)

    def receive(self) -> StepInputs | AdapterChange | None:
        """The next step's inputs, or an adapter slot's change; None when rank 0 says stop."""
        dist.broadcast(self.buffer, src=0, group=self.group)
        (kind, tokens, seqs, width, sampled, max_query_len, max_context_len, hidden_rows,
         lora_rows) = self.buffer[:_HEADER].tolist()
        if kind == _STOP:
            return None
        if kind == _ADAPTER:
            slot, length = tokens, seqs
            path = None if length < 0 else bytes(self.buffer[_HEADER:_HEADER + length].tolist()).decode()
            return AdapterChange(slot, path)
        sizes = [tokens, tokens, tokens, seqs + 1, seqs, seqs * width, sampled, lora_rows]
        parts = self.buffer[_HEADER:_HEADER + sum(sizes)].split(sizes)
        return StepInputs(parts[0].long(), parts[1].long(), parts[2].long(), parts[3].clone(), parts[4].clone(),
                          parts[5].reshape(seqs, width).clone(), parts[6].long(), max_query_len, max_context_len,
                          lora_slots=parts[7].long() if lora_rows else None, num_hidden_rows=hidden_rows)
