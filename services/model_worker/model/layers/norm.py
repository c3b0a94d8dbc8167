"""RMSNorm, in torch or in a C kernel on CPU, and its fusion with the rotary embedding for q and k."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.kernels import cpu_norm
from services.model_worker.model.layers.rotary import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # The C kernel (kernels/rms_norm.c) where the engine enabled it at load; None: torch ops.
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernel=None) -> torch.Tensor:
    """Normalise the last dim in float32 and scale in the model dtype, as the reference does.

    F.rms_norm gives the reference's x * rsqrt(mean(x^2) + eps) bit for bit, in one call instead
    of five; the C kernel does the same arithmetic in one call instead of about ten ops. weight:
    (D,), or one row per position of the dims before it.
    """
    if kernel is not None and cpu_norm.supports(x, weight):
        return cpu_norm.rms_norm(kernel, x, weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def norm_and_rotate(x: torch.Tensor, weight: torch.Tensor, eps: float, rope: tuple[torch.Tensor, torch.Tensor],
                    kernel=None) -> torch.Tensor:
    """rms_norm then apply_rotary on (T, heads, D): one C call where the kernel takes the layout."""
    if kernel is not None and cpu_norm.supports_rope(x, weight, rope):
        return cpu_norm.rms_norm_rope(kernel, x, weight, eps, rope)
    return apply_rotary(rms_norm(x, weight, eps, kernel), rope)


def use_norm_kernel(model: nn.Module, library) -> int:
    """Point every RMSNorm at the C kernel; returns how many."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.kernel = library
    return len(norms)
