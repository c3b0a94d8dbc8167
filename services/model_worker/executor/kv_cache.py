"""The paged KV cache: one preallocated pool of fixed-size blocks per layer, in the model's dtype or in 8 bits."""
from __future__ import annotations

import torch

from services.model_worker.config.model import Qwen3Config
from services.model_worker.host import hugepages
from services.model_worker.model.layers.attention.kv_quant import LayerCache, cache_dtype


class KVCache:
    """Per layer a key and a value tensor of shape (num_kv_heads, num_blocks * block_size, head_dim).

    Slot s of block b is column b * block_size + s. Head-major, so that one head's keys over a run
    of consecutive blocks are one contiguous stretch that attention reads in place. One tensor
    pair per layer rather than one for all layers: a layer's writes then touch its own tensors
    only (with one shared buffer, torch.compile was seen to copy the whole buffer every layer).

    spare_block: one block more than the block manager hands out (pad_block), written and read
    only by the padding rows of a CUDA-graph batch.

    kv_cache_dtype: "auto" keeps dtype (the model's); "fp8" and "int8" store 8 bits an element, and each
    layer's LayerCache carries its scales (kv_quant.py): fp8 a (1,) pair per layer, fp8_scales's where given
    (the checkpoint's, one (k_scale, v_scale) per layer), else 1.0; int8 one float32 per KV head and slot.
    """

    def __init__(self, config: Qwen3Config, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, spare_block: bool = False, huge_pages: bool = True,
                 kv_cache_dtype: str = "auto", fp8_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks if spare_block else None
        self.kv_cache_dtype = kv_cache_dtype
        dtype = cache_dtype(kv_cache_dtype, dtype)
        self.dtype = dtype
        num_slots = (num_blocks + spare_block) * block_size
        shape = (config.num_key_value_heads, num_slots, config.head_dim)
        # Zeros, not empty: attention reads masked slots too (weighted 0), which must hold finite values.
        if huge_pages and torch.device(device).type == "cpu":  # blocks read scattered: fewer TLB misses
            flat = hugepages.tensors([(shape, dtype)] * (2 * config.num_hidden_layers))
            for t in flat:
                # Already zero, but untouched: writing it now takes the page faults (each zeroing a 2 MiB
                # page) here, at start, instead of in the first steps that write each block.
                t.zero_()
        else:
            flat = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * config.num_hidden_layers)]
        scales = self._scales(config, num_slots, device, fp8_scales)
        self.layers = [LayerCache(k, v, *scale) for k, v, scale in zip(flat[0::2], flat[1::2], scales)]

    def _scales(self, config: Qwen3Config, num_slots: int, device: torch.device, fp8_scales) -> list[tuple]:
        """Each layer's (k_scale, v_scale): None for a cache in the model's dtype."""
        layers = config.num_hidden_layers
        if self.kv_cache_dtype == "fp8":
            given = fp8_scales or [(None, None)] * layers
            return [tuple(torch.ones(1, dtype=torch.float32, device=device) if s is None
                          else s.detach().to(device, torch.float32).reshape(1).clone() for s in pair)
                    for pair in given]
        if self.kv_cache_dtype == "int8":
            # Zeros: a slot never written dequantizes to 0, finite, as attention reads masked slots too.
            return [tuple(torch.zeros(config.num_key_value_heads, num_slots, dtype=torch.float32, device=device)
                          for _ in range(2)) for _ in range(layers)]
        return [(None, None)] * layers

    @staticmethod
    def bytes_per_block(config: Qwen3Config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """A block's bytes over all layers, keys and values: their elements, and int8's float32 scale per KV head
        and token (fp8's per-layer scales are a constant, not per block)."""
        rows = 2 * config.num_hidden_layers * config.num_key_value_heads * block_size
        element = torch.empty(0, dtype=cache_dtype(kv_cache_dtype, dtype)).element_size()
        return rows * (config.head_dim * element + (4 if kv_cache_dtype == "int8" else 0))
