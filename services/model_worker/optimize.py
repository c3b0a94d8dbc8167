"""Load-time speedups for CPU inference that keep the model's numerics: weights pre-packed for oneDNN."""
from __future__ import annotations

import logging

import torch
from torch import nn

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
