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
    """An nn.Linear (bf16, CPU) whose matmul runs in a C kernel when a decode batch's rows come in.

    A decode step of up to a few dozen sequences only streams the weights: the small-batch kernel
    (kernels/small_batch_linear.c) does that at close to memory speed for one or two rows, the AMX
    kernel (kernels/amx_linear.c) from there to 32 rows, and oneDNN at about half that speed. Short
    prefills are compute-bound, and the AMX kernel still beats oneDNN on plain weights there, up to
    AMX_MAX_ROWS; longer ones go to F.linear. The weight stays in its plain
    layout, shared with the checkpoint's tensor: no second copy.
    """

    MAX_ROWS = 4       # the AVX512-BF16 kernel: faster than oneDNN up to 4 rows here, slower from 8
    AMX_MIN_ROWS = 3   # measured: the AMX kernel beats the AVX512-BF16 one from 3 rows
    # Measured on the 0.6B model's weights, 28 layers streamed: the AMX kernel took 0.58-0.71x
    # oneDNN's time at 32 and 64 rows, 0.68-0.83x at 128, 0.92-1.14x at 256 and 1.14-1.44x at 512.
    AMX_MAX_ROWS = 128

    def __init__(self, linear: nn.Linear, library, amx=None):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.library = library
        self.amx = amx if amx is not None and self.weight.shape[0] % 32 == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.amx is not None and self.AMX_MIN_ROWS <= rows <= self.AMX_MAX_ROWS:
            out = cpu_linear.amx_linear(self.amx, x, self.weight)
        elif rows <= self.MAX_ROWS:
            out = cpu_linear.small_batch_linear(self.library, x, self.weight)
        else:
            return F.linear(x, self.weight, self.bias)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}, "
                f"bias={self.bias is not None}, amx={self.amx is not None}")


def use_small_batch_kernel(model: nn.Module, library, amx=None) -> int:
    """Swap every bf16 nn.Linear whose shape the kernel takes for a SmallBatchLinear; returns how many."""
    swaps = [(name, module) for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and cpu_linear.supports(module.weight)]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, SmallBatchLinear(module, library, amx))
    log.info("small-batch matmul kernels for %d linear weights (AMX for 3-32 rows: %s)", len(swaps),
             "yes" if amx is not None else "no")
    return len(swaps)


def use_norm_kernel(model: nn.Module, library) -> int:
    """Point every RMSNorm at the C kernel; returns how many."""
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    for norm in norms:
        norm.kernel = library
    return len(norms)
