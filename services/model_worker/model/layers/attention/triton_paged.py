"""The GPU backend: decodes and prefills of a step in one Triton kernel per layer."""
from __future__ import annotations

from services.model_worker.kernels import triton_attention
from services.model_worker.model.layers.attention.backend import AttentionBackend


class TritonPagedAttention(AttentionBackend):
    """The whole step, decodes and prefills, in one Triton kernel per layer (the GPU backend).

    An 8-bit cache (k_scale, v_scale given) is written by kernels/triton_kv_write.py, which quantizes as it
    scatters, and read by the same attention kernel, which widens its rows in registers.
    """

    name = "triton"
    whole_step = True

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        if k_scale is None:
            return super().write_kv(k, v, k_cache, v_cache, slot_mapping)
        # Imported here, on the 8-bit path only: the model-dtype cache never needs the module.
        from services.model_worker.kernels import triton_kv_write

        triton_kv_write.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def attend(self, q, k_cache, v_cache, query_start_loc, context_lens, block_tables, block_size, max_query_len,
               scale, **scales):
        return triton_attention.paged_attention(q, k_cache, v_cache, query_start_loc, context_lens, block_tables,
                                                block_size, max_query_len, scale, **scales)
