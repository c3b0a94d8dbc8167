"""Which attention backend runs on a device: the fastest one that works there."""
from __future__ import annotations

import functools

import torch

from services.model_worker.kernels import cpu_attention, cpu_prefill_attention, triton_attention
from services.model_worker.model.layers.attention.backend import AttentionBackend
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention
from services.model_worker.model.layers.attention.sdpa import TorchAttention
from services.model_worker.model.layers.attention.triton_paged import TritonPagedAttention


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
