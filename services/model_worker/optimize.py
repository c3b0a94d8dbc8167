"""Load-time speedups for CPU inference: weights packed for oneDNN, or C kernels for small-batch bf16 matmuls and RMSNorm."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.kernels import cpu_linear
from services.model_worker.models.qwen3 import RMSNorm

log = logging.getLogger(__name__)

# oneDNN lays a packed weight out for this many input rows (other row counts still run correctly).
# A decode step has one row per running sequence. Measured on the engine (0.6B shape, bf16, Xeon
# with AMX, weights streamed from memory): a layout for 16 rows decoded one sequence in 121 ms a
# step against 165 ms for a layout for 1 row (and 136 ms unpacked), and it is the batch serving runs.
DECODE_ROWS_HINT = 16


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """A frozen nn.Linear whose weight is reordered once into oneDNN's blocked layout.

    F.linear hands oneDNN a plain row-major weight, which it re-blocks on the fly at every call;
    reading a pre-blocked one is what makes a small-batch matmul run near memory speed. These are
    the ops inductor's weight freezing emits (torch/_inductor/fx_passes/mkldnn_fusion.py). bf16
    results are bit-identical to F.linear's; fp32 ones differ in summation order only.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A plain attribute, not a buffer: an opaque oneDNN tensor has no place in a state dict.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), DECODE_ROWS_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, include_lm_head: bool = True) -> int:
    """Swap every nn.Linear in the model for a PackedLinear; returns how many were swapped.

    A head tied to the embedding gets a packed copy of its own (the embedding still needs the
    plain table), which costs vocab x hidden more memory; include_lm_head=False skips it.
    """
    swaps = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and (include_lm_head or not name.endswith("lm_head"))]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(module))
    log.info("packed %d linear weights for oneDNN", len(swaps))
    return len(swaps)


class SmallBatchLinear(nn.Module):
    """An nn.Linear (bf16, CPU) whose matmul runs in a C kernel when few rows come in.

    A decode step of one to a few sequences only streams the weights, which the kernel does at
    close to memory speed and oneDNN at about half that (kernels/small_batch_linear.c); more rows
    (prefill, large batches) are compute-bound and go to F.linear. The weight stays in its plain
    layout, shared with the checkpoint's tensor: no second copy.
    """

    MAX_ROWS = 4  # measured: faster than oneDNN up to 4 rows here, slower from 8

    def __init__(self, linear: nn.Linear, library):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.library = library

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // x.shape[-1] > self.MAX_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = cpu_linear.small_batch_linear(self.library, x, self.weight)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, bias={self.bias is not None}"


def use_small_batch_kernel(model: nn.Module, library) -> int:
    """Swap every bf16 nn.Linear whose shape the kernel takes for a SmallBatchLinear; returns how many."""
    swaps = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and cpu_linear.supports(module.weight)]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, SmallBatchLinear(module, library))
    log.info("small-batch matmul kernel for %d linear weights", len(swaps))
    return len(swaps)


def use_norm_kernel(model: nn.Module, library) -> int:
    """Point every RMSNorm at the C kernel; returns how many."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.kernel = library
    return len(norms)
