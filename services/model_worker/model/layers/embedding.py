"""The token embedding, split by vocabulary across tensor-parallel ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.model.layers.weights import CheckpointTensor, split_rows


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary: each rank looks up the ids it holds, zeros the rest, and the ranks sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.rows = vocab_size // tp.size
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))

    def weight_loader(self, leaf: str, source: CheckpointTensor, shard=None) -> None:
        """This rank's rows of the table (the head tied to it shares them)."""
        self.weight.data.copy_(split_rows(source, self.weight.data, 0, self.tp))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))
