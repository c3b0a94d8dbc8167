"""The paged KV cache: one preallocated pool of fixed-size blocks per layer."""
from __future__ import annotations

import torch

from services.model_worker.config.model import Qwen3Config
from services.model_worker.host import hugepages


class KVCache:
    """Per layer a key and a value tensor of shape (num_kv_heads, num_blocks * block_size, head_dim).

    Slot s of block b is column b * block_size + s. Head-major, so that one head's keys over a run
    of consecutive blocks are one contiguous stretch that attention reads in place. One tensor
    pair per layer rather than one for all layers: a layer's writes then touch its own tensors
    only (with one shared buffer, torch.compile was seen to copy the whole buffer every layer).

    spare_block: one block more than the block manager hands out (pad_block), written and read
    only by the padding rows of a CUDA-graph batch.
    """

    def __init__(self, config: Qwen3Config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, spare_block: bool = False, huge_pages: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks if spare_block else None
        shape = (config.num_key_value_heads, (num_blocks + spare_block) * block_size, config.head_dim)
        # Zeros, not empty: attention reads masked slots too (weighted 0), which must hold finite values.
        if huge_pages and torch.device(device).type == "cpu":  # blocks read scattered: fewer TLB misses
            flat = hugepages.tensors([(shape, dtype)] * (2 * config.num_hidden_layers))
            for t in flat:
                # Already zero, but untouched: writing it now takes the page faults (each zeroing a 2 MiB
                # page) here, at start, instead of in the first steps that write each block.
                t.zero_()
        else:
            flat = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * config.num_hidden_layers)]
        self.layers = list(zip(flat[0::2], flat[1::2]))

    @staticmethod
    def bytes_per_block(config: Qwen3Config, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return per_token * block_size * torch.empty(0, dtype=dtype).element_size()
