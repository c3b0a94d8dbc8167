"""The CPU backend: decodes in a C kernel that reads keys in place through the block tables, bf16
prompts in another (AMX tiles, or AVX512-BF16 register tiles without AMX)."""
from __future__ import annotations

import torch

from services.model_worker.kernels import cpu_attention, cpu_prefill_attention
from services.model_worker.model.layers.attention import kv_quant
from services.model_worker.model.layers.attention.sdpa import TorchAttention


class CpuPagedAttention(TorchAttention):
    """Decodes through the C kernel, which reads keys in place through the block tables.

    prefill_library: the prefill kernel (kernels/prefill_attention.c), or None for SDPA. For one layer
    of a 32-768-token prompt (16 heads of 128, one CPU) it took 0.46-0.57x SDPA's time on AMX, and
    0.21-0.37x with AVX512-BF16 alone (AMD's Zen 4, where SDPA is slower).
    """

    name = "cpu-paged"

    def __init__(self, library, prefill_library=None):
        self.library = library
        self.prefill_library = prefill_library

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, **scales):
        # One C call for four torch ops: at 16 sequences index_copy_ alone took about 3 ms a step.
        if cpu_attention.can_write_kv(k, v, k_cache, v_cache, slot_mapping, **scales):
            cpu_attention.write_kv(self.library, k, v, k_cache, v_cache, slot_mapping, **scales)
        else:
            super().write_kv(k, v, k_cache, v_cache, slot_mapping, **scales)

    def decode(self, q, k_cache, v_cache, context_lens, block_tables, block_size, scale, **scales):
        if not cpu_attention.supports(q.dtype):
            return super().decode(q, k_cache, v_cache, context_lens, block_tables, block_size, scale, **scales)
        return cpu_attention.paged_decode_attention(self.library, q, k_cache, v_cache, context_lens, block_tables,
                                                    block_size, scale, **scales)

    def prefill(self, q, k, v, k_cache, v_cache, layout, scale, out=None, k_scale=None, v_scale=None):
        """An 8-bit cache's cached rows are gathered and dequantized to bf16 in torch for the prefill kernel,
        which reads bf16 only (a fresh prompt's own rows come as stored: dispatch.paged_attention)."""
        eight_bit = k_scale is not None
        caches = (k, v) if eight_bit else (k_cache, v_cache)
        if self.prefill_library is None or not cpu_prefill_attention.supports(q, k, v, *caches):
            return super().prefill(q, k, v, k_cache, v_cache, layout, scale, out, k_scale, v_scale)
        if out is None:  # the step is this one sequence: all of q
            out = torch.empty_like(q)
        for start, n, slots in zip(layout.starts, layout.lens, layout.key_slots):
            rows = slice(start, start + n)
            if slots is None:  # a fresh prompt: its keys are its own rows
                cpu_prefill_attention.prefill_attention(self.prefill_library, q[rows], k[rows], v[rows], scale,
                                                        out[rows])
            elif eight_bit:  # its keys gathered in order and widened: the kernel reads them through slots 0..Lk-1
                keys = kv_quant.gather_rows(k_cache, k_scale, slots, q.dtype).contiguous()
                values = kv_quant.gather_rows(v_cache, v_scale, slots, q.dtype).contiguous()
                order = torch.arange(slots.shape[0], dtype=torch.int64)
                cpu_prefill_attention.prefill_attention(self.prefill_library, q[rows], keys, values, scale,
                                                        out[rows], order)
            else:  # cached tokens before it: every key read through its slot
                cpu_prefill_attention.prefill_attention(self.prefill_library, q[rows], k_cache, v_cache, scale,
                                                        out[rows], slots)
        return out
