"""The CPU backend: decodes in a C kernel that reads keys in place through the block tables."""
from __future__ import annotations

from services.model_worker.kernels import cpu_attention
from services.model_worker.model.layers.attention.sdpa import TorchAttention


class CpuPagedAttention(TorchAttention):
    """Decodes through the C kernel, which reads keys in place through the block tables."""

    name = "cpu-paged"

    def __init__(self, library):
        self.library = library

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        # One C call for four torch ops: at 16 sequences index_copy_ alone took about 3 ms a step.
        if cpu_attention.can_write_kv(k, v, k_cache, v_cache, slot_mapping):
            cpu_attention.write_kv(self.library, k, v, k_cache, v_cache, slot_mapping)
        else:
            super().write_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, context_lens, block_tables, block_size, scale):
        if not cpu_attention.supports(q.dtype):
            return super().decode(q, k_cache, v_cache, context_lens, block_tables, block_size, scale)
        return cpu_attention.paged_decode_attention(self.library, q, k_cache, v_cache, context_lens, block_tables,
                                                    block_size, scale)
