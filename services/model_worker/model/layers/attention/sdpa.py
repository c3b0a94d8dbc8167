"""Plain PyTorch attention: SDPA over keys gathered from the cache, for decodes on any device and for prompt chunks."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.model_worker.model.layers.attention import kv_quant
from services.model_worker.model.layers.attention.backend import AttentionBackend, gather_cache
from services.model_worker.model.layers.attention.layout import PrefillLayout, cache_slots


class TorchAttention(AttentionBackend):
    """Plain PyTorch for every device: decodes are padded prefills of one query (SDPA over gathered keys)."""

    name = "torch"

    def decode(self, q, k_cache, v_cache, context_lens, block_tables, block_size, scale, k_scale=None,
               v_scale=None):
        n, max_k = context_lens.shape[0], int(context_lens.max())
        slots = cache_slots(block_tables, max_k, block_size).flatten()
        j = torch.arange(max_k, device=q.device)
        mask = (j[None, :] < context_lens[:, None])[:, None, None, :]        # (N, 1, 1, Lk)
        keys = gather_cache(k_cache, slots, n, k_scale, q.dtype)
        values = gather_cache(v_cache, slots, n, v_scale, q.dtype)
        num_kv_heads = k_cache.shape[0]
        queries = q.reshape(n, num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2])
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(n, q.shape[1], q.shape[2])

    def prefill(self, q, k, v, k_cache, v_cache, layout, scale, out=None, k_scale=None, v_scale=None):
        return prefill_attention(q, k, v, k_cache, v_cache, layout, scale, out, k_scale, v_scale)


def prefill_attention(q, k, v, k_cache, v_cache, layout: PrefillLayout, scale: float,
                      out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill rows' attention, one SDPA call per sequence on its own rows (see PrefillLayout).

    out: (T, H, D) to write each sequence's rows into, at its rows of the flat batch; None: the
    step is one sequence alone and its result is returned as (Lq, H, D). An 8-bit cache's rows are
    dequantized as they are gathered (k_scale, v_scale: its scales).
    """
    gqa = k.shape[1] != q.shape[1]
    for i, (start, n) in enumerate(zip(layout.starts, layout.lens)):
        queries = q[start:start + n].transpose(0, 1).unsqueeze(0)              # (1, H, Lq, D), a view
        slots = layout.key_slots[i]
        if slots is None:
            keys = k[start:start + n].transpose(0, 1).unsqueeze(0)             # (1, Hkv, Lq, D)
            values = v[start:start + n].transpose(0, 1).unsqueeze(0)
        else:
            keys = kv_quant.gather_rows(k_cache, k_scale, slots, q.dtype).unsqueeze(0)    # (1, Hkv, Lk, D)
            values = kv_quant.gather_rows(v_cache, v_scale, slots, q.dtype).unsqueeze(0)
        mask = layout.masks[i]
        result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, is_causal=mask is None,
                                                scale=scale, enable_gqa=gqa)[0].transpose(0, 1)  # (Lq, H, D)
        if out is None:
            return result
        out[start:start + n] = result
    return out
