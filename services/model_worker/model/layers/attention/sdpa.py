"""Plain PyTorch attention: SDPA over keys gathered from the cache, for decodes on any device and for prompt chunks."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.model_worker.model.layers.attention.backend import AttentionBackend, cache_slots, gather_cache

if TYPE_CHECKING:  # annotations only: the metadata module imports this one
    from services.model_worker.model.layers.attention.metadata import PrefillLayout


class TorchAttention(AttentionBackend):
    """Plain PyTorch for every device: decodes are padded prefills of one query (SDPA over gathered keys)."""

    name = "torch"

    def decode(self, q, k_cache, v_cache, context_lens, block_tables, block_size, scale):
        n, max_k = context_lens.shape[0], int(context_lens.max())
        slots = cache_slots(block_tables, max_k, block_size).flatten()
        j = torch.arange(max_k, device=q.device)
        mask = (j[None, :] < context_lens[:, None])[:, None, None, :]        # (N, 1, 1, Lk)
        keys = gather_cache(k_cache, slots, n)
        values = gather_cache(v_cache, slots, n)
        num_kv_heads = k_cache.shape[0]
        queries = q.reshape(n, num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2])
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(n, q.shape[1], q.shape[2])


def prefill_attention(q, k, v, k_cache, v_cache, layout: PrefillLayout, scale: float) -> torch.Tensor:
    """The prefill rows' attention, in batch order: one SDPA call over the padded layout."""
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    batch, max_q = layout.query_rows.shape

    def pick(t: torch.Tensor) -> torch.Tensor:
        """t's prefill rows as (P, Lq, ...): a view for one sequence, else a padded copy."""
        if layout.single_start is not None:
            return t[layout.single_start:layout.single_start + max_q].unsqueeze(0)
        return t[layout.query_rows]

    queries = pick(q).transpose(1, 2)                                          # (P, H, Lq, D)
    if layout.key_slots is None:
        keys, values = pick(k).transpose(1, 2), pick(v).transpose(1, 2)        # (P, Hkv, Lq, D)
    else:
        keys = gather_cache(k_cache, layout.key_slots, batch)
        values = gather_cache(v_cache, layout.key_slots, batch)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.mask,
                                         is_causal=layout.mask is None, scale=scale,
                                         enable_gqa=num_kv_heads != num_heads)  # (P, H, Lq, D)
    out = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
    return out if layout.single_start is not None else out[layout.out_rows]
