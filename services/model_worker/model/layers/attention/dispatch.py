"""The one place attention is dispatched: which backend runs on a device, and how a layer's call is routed through it."""
from __future__ import annotations

from typing import TYPE_CHECKING

import functools

import torch

from services.model_worker.kernels import cpu_attention, cpu_prefill_attention, triton_attention
from services.model_worker.model.layers.attention.backend import AttentionBackend
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention
from services.model_worker.model.layers.attention.sdpa import TorchAttention
from services.model_worker.model.layers.attention.triton_paged import TritonPagedAttention

if TYPE_CHECKING:  # annotations only: the metadata module imports this one
    from services.model_worker.model.layers.attention.metadata import AttentionMetadata


@functools.lru_cache(maxsize=None)
def default_backend(device: torch.device) -> AttentionBackend:
    """The fastest backend that runs here: Triton on CUDA, the C kernels on CPU, else PyTorch.

    On CPU, decodes take the paged C kernel (float32, bfloat16); bf16 prompts take the prefill one
    where the CPU has AVX512-BF16 (on AMX tiles where it has AMX), SDPA elsewhere.
    """
    if device.type == "cuda" and triton_attention.available():
        return TritonPagedAttention()
    if device.type == "cpu":
        library = cpu_attention.load()
        if library is not None:
            return CpuPagedAttention(library, cpu_prefill_attention.load())
    return TorchAttention()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (Hkv, slots, D). Writes k, v to the cache; returns (T, H, D)."""
    meta.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.backend.whole_step:
        return meta.backend.attend(q, k_cache, v_cache, meta, scale)
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
