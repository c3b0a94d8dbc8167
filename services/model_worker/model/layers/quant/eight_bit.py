"""8-bit weights as a LinearMethod: fp8 e4m3 with 128 x 128 block scales (Qwen's FP8 checkpoints, or a bf16
checkpoint quantized on load) and int8 with one scale per output row (quantized on load).

Whatever the format, a loaded layer holds `weight` (N, K) in 8 bits and `weight_scale_inv` (N, ceil(K /
block_k)) float32, the weight being weight * weight_scale_inv (quantize.py); an int8 layer on the VNNI kernel
holds its weight packed instead (flat, uint8; int8_weight gives the (N, K) one back). How it is multiplied:
- CPU, bf16 activations, int8 weights (unless int8_activations is off): the activations are quantized to
  int8 in the call, one scale per row, and multiplied in integers by kernels/w8a8_linear.c at every row
  count: AMX-INT8 tiles where the CPU has them; without them, AVX512-VNNI register tiles on the weight packed
  once at load into the order they stream (quantize.pack_int8_vnni; outputs a multiple of 16, else the
  paths below).
- CPU, bf16 activations, otherwise: the C kernels of kernels/q8_linear.c read the bytes and widen them in
  registers: a few rows (decode) by AVX-512 fused multiply-adds, more rows on AMX tiles over 32 weight
  rows dequantized at a time in cache; long prompts (over AMX_MAX_ROWS rows, where oneDNN's GEMM is the
  fastest) multiply a bf16 dequantization of the one layer, made for that call and dropped after it.
- CUDA: the Triton kernel of kernels/triton_w8_linear.py, which widens the bytes in registers too.
- Anything else (float32, float16, a CPU without AVX-512): F.linear on q * scale dequantized in float32
  for the call; in float32 that is exactly the weight a float32 dequantization of the checkpoint holds.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.config.quantization import FP8_BLOCK
from services.model_worker.kernels import cpu_q8_linear
from services.model_worker.model.layers.linear import (LinearMethod, MergedColumnParallelLinear, QKVParallelLinear,
                                                       RowParallelLinear)
from services.model_worker.model.layers.quant.quantize import (RowScales, dequantize, pack_int8_vnni,
                                                               quantize_fp8_blocks, quantize_int8, unpack_int8_vnni)

SCALE = "weight_scale_inv"  # the checkpoint's name: the weight is q * weight_scale_inv


class EightBitLinearMethod(LinearMethod):
    """fmt "fp8" or "int8"; from_checkpoint: the checkpoint holds the 8-bit weights and their scales (fp8
    only), else its bf16/float32 weights are quantized once loaded. kernels: the CPU kernels, or None.
    int8_activations: int8 weights on CPU in bf16 multiply activations quantized to int8 per row (the
    w8a8 kernels, where the CPU has them); False keeps bf16 activations."""

    GEMV_MAX_ROWS = 4     # the AVX-512 kernel up to this many rows; AMX above, where the CPU has it
    NO_AMX_MAX_ROWS = 16  # without AMX, the AVX-512 kernel up to here
    AMX_MAX_ROWS = 128    # as SmallBatchLinearMethod's: above, oneDNN on a dequantized copy for the call

    def __init__(self, fmt: str, from_checkpoint: bool, kernels: cpu_q8_linear.Q8Kernels | None = None,
                 triton: bool = False, int8_activations: bool = True):
        if fmt not in ("fp8", "int8") or (from_checkpoint and fmt != "fp8"):
            raise ValueError(f"no 8-bit format {fmt!r}{' in checkpoints' if from_checkpoint else ''}")
        self.fmt, self.from_checkpoint, self.kernels, self.triton = fmt, from_checkpoint, kernels, triton
        self.int8_activations = int8_activations and fmt == "int8"
        a8 = self.int8_activations and kernels is not None and (kernels.w8a8_amx or kernels.w8a8_vnni)
        self.name = f"{fmt}-{'checkpoint' if from_checkpoint else 'quantized-on-load'}{'-a8' if a8 else ''}"

    def create_weights(self, layer, in_features, out_features, bias):
        if not self.from_checkpoint:
            super().create_weights(layer, in_features, out_features, bias)  # quantized after loading
            return
        block_rows, block_k = FP8_BLOCK
        if isinstance(layer, RowParallelLinear) and layer.tp.size > 1 and in_features % block_k:
            raise ValueError(
                f"fp8 blocks of {block_k} inputs cannot be split across {layer.tp.size} tensor-parallel ranks: each "
                f"rank's share of a row-parallel layer's {in_features * layer.tp.size} inputs ({in_features}) "
                f"must be a multiple of {block_k}")
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                    requires_grad=False)
        layer.register_parameter(SCALE, nn.Parameter(
            torch.empty(out_features, -(-in_features // block_k), dtype=torch.float32), requires_grad=False))
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def checkpoint_tensor(self, layer, leaf, source, rows):
        # The checkpoint's scales are per block of 128 rows; the layer holds one row of them per weight row.
        return RowScales(source, FP8_BLOCK[0], rows) if leaf == SCALE else source

    def process_weights_after_loading(self, layer):
        if not self.from_checkpoint:
            weight = layer.weight.detach()
            if self.fmt == "int8":
                q, scales = quantize_int8(weight, layer.tp if isinstance(layer, RowParallelLinear) else None)
            else:
                # Each part of a fused layer (q, k, v; gate, up) in blocks of its own, as a checkpoint holds them.
                qs, row_scales = [], []
                for part in weight.split(row_parts(layer)):
                    q, block_scales = quantize_fp8_blocks(part)
                    qs.append(q)
                    row_scales.append(block_scales.repeat_interleave(FP8_BLOCK[0], 0)[:part.shape[0]])
                q, scales = torch.cat(qs), torch.cat(row_scales).contiguous()
            # A new tensor: a head tied to the embedding leaves the embedding's table as it is.
            layer.weight = nn.Parameter(q.to(weight.device), requires_grad=False)
            layer.register_parameter(SCALE, nn.Parameter(scales.to(weight.device), requires_grad=False))
        layer.block_k = FP8_BLOCK[1] if self.fmt == "fp8" else layer.weight.shape[1]
        weight = layer.weight
        on_cpu_kernel = self.kernels is not None and cpu_q8_linear.supports(weight, layer.block_k)
        layer.q8 = self.kernels if on_cpu_kernel else None
        layer.q8_amx = on_cpu_kernel and self.kernels.amx and weight.shape[0] % 32 == 0
        # The int8 x int8 kernels at every row count: AMX-INT8 tiles on the weight as it is, else AVX512-VNNI on
        # the weight packed once into the order its register tiles stream (pack_int8_vnni), in place of it.
        a8 = on_cpu_kernel and self.int8_activations and weight.dtype == torch.int8
        layer.w8a8_amx = a8 and self.kernels.w8a8_amx and weight.shape[0] % 32 == 0
        layer.w8a8_vnni = a8 and not layer.w8a8_amx and self.kernels.w8a8_vnni and weight.shape[0] % 16 == 0
        if layer.w8a8_vnni:
            layer.weight = nn.Parameter(pack_int8_vnni(weight.data), requires_grad=False)
        layer.w8_triton = self.triton and weight.device.type == "cuda"

    def apply(self, layer, x):
        out = self._matmul(layer, x)
        return out if layer.bias is None else out + layer.bias

    def _matmul(self, layer, x: torch.Tensor) -> torch.Tensor:
        weight, scales = layer.weight, getattr(layer, SCALE)
        if layer.q8 is not None and x.dtype == torch.bfloat16:
            rows = x.numel() // x.shape[-1]
            if layer.w8a8_amx or layer.w8a8_vnni:
                return cpu_q8_linear.w8a8_linear(layer.q8, x, weight, scales, amx=layer.w8a8_amx)
            if rows <= self.GEMV_MAX_ROWS or (not layer.q8_amx and rows <= self.NO_AMX_MAX_ROWS):
                return cpu_q8_linear.linear(layer.q8, x, weight, scales, layer.block_k, amx=False)
            if layer.q8_amx and rows <= self.AMX_MAX_ROWS:
                return cpu_q8_linear.linear(layer.q8, x, weight, scales, layer.block_k, amx=True)
            return F.linear(x, cpu_q8_linear.dequantize(layer.q8, weight, scales, layer.block_k))
        if layer.w8_triton:
            from services.model_worker.kernels import triton_w8_linear  # imports triton: CUDA hosts only
            return triton_w8_linear.w8_linear(x, weight, scales, layer.block_k)
        return F.linear(x, dequantize(int8_weight(layer), scales, layer.block_k, x.dtype))


def int8_weight(layer) -> torch.Tensor:
    """The layer's 8-bit weight as (N, K), its VNNI packing undone where it has one."""
    return unpack_int8_vnni(layer.weight, layer.weight_scale_inv.shape[0]) if layer.w8a8_vnni else layer.weight


def row_parts(layer) -> list[int]:
    """The row counts of the checkpoint tensors a layer's weight is made of (this rank's share of each)."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.q_size, layer.kv_size, layer.kv_size]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(layer.local_sizes)
    return [layer.out_features]
