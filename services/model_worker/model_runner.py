"""Turns a scheduled batch into one flat forward pass and returns the logits to sample from."""
from __future__ import annotations

import torch

from services.model_worker.attention import AttentionBackend, AttentionMetadata, default_backend
from services.model_worker.kv_cache import KVCache
from services.model_worker.models.qwen3 import Qwen3ForCausalLM
from services.model_worker.scheduler import ScheduledBatch
from services.model_worker.sequence import Sequence


class ModelRunner:
    def __init__(self, model: Qwen3ForCausalLM, kv_cache: KVCache, device: torch.device,
                 attention: AttentionBackend | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.attention = attention or default_backend(device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor | None]:
        """Compute this step's tokens; return the sequences that now need a next token, and their logits."""
        input_ids: list[int] = []
        positions: list[int] = []
        context_lens, sample_rows, sample_seqs = [], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_cached_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            context_lens.append(start + n)
            # A prompt prefilled in chunks yields a token only after its last chunk.
            if start + n == len(seq):
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        meta = AttentionMetadata.build([s.block_table for s in batch.seqs], context_lens, batch.num_tokens,
                                       self.kv_cache.block_size, self.device, self.attention)
        hidden = self.model(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                            self.kv_cache.layers, meta)
        if not sample_seqs:
            return [], None
        rows = torch.tensor(sample_rows, device=self.device)
        return sample_seqs, self.model.compute_logits(hidden[rows]).float()
