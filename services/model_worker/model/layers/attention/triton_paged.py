"""The GPU backend: decodes and prefills of a step in one Triton kernel per layer."""
from __future__ import annotations

from services.model_worker.kernels import triton_attention
from services.model_worker.model.layers.attention.backend import AttentionBackend


class TritonPagedAttention(AttentionBackend):
    """The whole step, decodes and prefills, in one Triton kernel per layer (the GPU backend)."""

    name = "triton"
    whole_step = True

    def attend(self, q, k_cache, v_cache, query_start_loc, context_lens, block_tables, block_size, max_query_len,
               scale):
        return triton_attention.paged_attention(q, k_cache, v_cache, query_start_loc, context_lens, block_tables,
                                                block_size, max_query_len, scale)
