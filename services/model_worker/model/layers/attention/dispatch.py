"""The one place a layer's attention call is routed through the step's backend: decodes, prefills, or the whole step."""
from __future__ import annotations

import torch

from services.model_worker.model.layers.attention.metadata import AttentionMetadata


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (Hkv, slots, D). Writes k, v to the cache; returns (T, H, D)."""
    meta.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.backend.whole_step:
        return meta.backend.attend(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables,
                                   meta.block_size, meta.max_query_len, scale)
    if meta.max_query_len == 1:  # a pure decode step, the common case
        return meta.backend.decode(q, k_cache, v_cache, meta.context_lens, meta.block_tables, meta.block_size, scale)
    layout = meta.prefill
    if layout.single_start == 0 and layout.lens[0] == q.shape[0]:  # the step is one prefill
        return meta.backend.prefill(q, k, v, k_cache, v_cache, layout, scale)
    out = torch.empty_like(q)
    if meta.decode_seqs.numel():
        out[meta.decode_rows] = meta.backend.decode(q[meta.decode_rows], k_cache, v_cache,
                                                    meta.context_lens[meta.decode_seqs],
                                                    meta.block_tables[meta.decode_seqs], meta.block_size, scale)
    return meta.backend.prefill(q, k, v, k_cache, v_cache, layout, scale, out)
