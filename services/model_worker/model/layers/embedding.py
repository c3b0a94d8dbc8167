"""The token embedding, split by vocabulary across tensor-parallel ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.kernels import cpu_linear
from services.model_worker.model.layers.weights import CheckpointTensor, split_rows


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary: each rank looks up the ids it holds, zeros the rest, and the ranks sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.rows = vocab_size // tp.size
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.vnni = None  # vnni_linear.c, where the table is held in its order (share_with_head)

    def weight_loader(self, leaf: str, source: CheckpointTensor, shard=None) -> None:
        """This rank's rows of the table (the head tied to it shares them)."""
        self.weight.data.copy_(split_rows(source, self.weight.data, 0, self.tp))

    def share_with_head(self, head: nn.Module) -> None:
        """After loading, for a head tied to this table: where the head's method reordered their shared weight in
        place into VNNI order (VnniLinearMethod), look the rows up in that order, from the same storage."""
        packed = getattr(head, "vnni_weight", None)
        if packed is not None and packed.data_ptr() == self.weight.data_ptr():
            self.weight = packed
            library = getattr(head, "vnni", None)
            self.vnni = library if library is not None and hasattr(library, "vnni_rows") else None

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dim() == 4:
            if self.vnni is not None and ids.device.type == "cpu":
                # One stream a row: 512 ids in 1.3 ms on one core, where the indexing below took 7.7 ms.
                return cpu_linear.vnni_rows(self.vnni, self.weight, ids)
            # (rows / 16, hidden / 2, 16, 2): row i is lane i % 16 of block i // 16, its pairs in order.
            return self.weight[ids // 16, :, ids % 16].reshape(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = self.lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(hidden.masked_fill_(outside[:, None], 0))
