"""Host-to-device copies that never stall the host waiting for the GPU.

A plain `torch.tensor(values, device="cuda")` copies from pageable memory, and CUDA runs such a
copy only after everything queued before it: the host waits for the GPU to drain, every time.
From pinned memory with non_blocking the copy is queued like a kernel and the host goes on.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list (or host tensor) on the device, queued behind earlier work without a sync."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return upload(host.to(dtype), device)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()  # the caching host allocator keeps it alive until the copy is done
    return host.to(device, non_blocking=True)


def upload_all(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Several host integer tensors as one copy: packed into one int64 buffer, split on the device."""
    if device.type == "cpu":
        return tensors
    flat = upload(torch.cat([t.flatten().to(torch.int64) for t in tensors]), device)
    out, start = [], 0
    for t in tensors:
        part = flat[start:start + t.numel()].view(t.shape)
        out.append(part if t.dtype == torch.int64 else part.to(t.dtype))
        start += t.numel()
    return out
