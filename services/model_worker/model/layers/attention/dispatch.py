"""The one place a layer's attention call is routed through the step's backend: decodes, prefills, or the whole step."""
from __future__ import annotations

import torch

from services.model_worker.model.layers.attention import kv_quant
from services.model_worker.model.layers.attention.metadata import AttentionMetadata


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, **scales) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (Hkv, slots, D). Writes k, v to the cache; returns (T, H, D).

    scales: an 8-bit cache's k_scale and v_scale (kv_quant.py); none for a cache in the model's dtype. A prompt
    then attends to its own keys and values as stored (quantized and back), as it does to cached ones: a prompt
    gets the same result whether it prefills in one step or in chunks, and whether its prefix was cached or not.
    """
    backend = meta.backend
    backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, **scales)
    if backend.whole_step:
        return backend.attend(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens, meta.block_tables,
                              meta.block_size, meta.max_query_len, scale, **scales)
    if meta.max_query_len == 1:  # a pure decode step, the common case
        return backend.decode(q, k_cache, v_cache, meta.context_lens, meta.block_tables, meta.block_size, scale,
                              **scales)
    if scales:
        k = kv_quant.as_stored(k, k_cache.dtype, scales["k_scale"])
        v = kv_quant.as_stored(v, v_cache.dtype, scales["v_scale"])
    layout = meta.prefill
    if layout.single_start == 0 and layout.lens[0] == q.shape[0]:  # the step is one prefill
        return backend.prefill(q, k, v, k_cache, v_cache, layout, scale, **scales)
    out = torch.empty_like(q)
    if meta.decode_seqs.numel():
        out[meta.decode_rows] = backend.decode(q[meta.decode_rows], k_cache, v_cache,
                                               meta.context_lens[meta.decode_seqs],
                                               meta.block_tables[meta.decode_seqs], meta.block_size, scale, **scales)
    return backend.prefill(q, k, v, k_cache, v_cache, layout, scale, out, **scales)
