"""8-bit mixture-of-experts weights: fp8 e4m3 in 128 x 128 blocks (Qwen's FP8 MoE checkpoints, or a bf16
checkpoint quantized on load) and int8 with one scale per output row (quantized on load).

A FusedMoE in 8 bits holds w13 (E, 2I, H) and w2 (E, H, I) as int8 or float8_e4m3fn, and w13_scale
(E, 2I, ceil(H / block)) and w2_scale (E, H, ceil(I / block)) float32: one row of scales per weight row,
as the 8-bit linear layers hold theirs (quantize.py), so gate and up and a tensor-parallel rank's rows may
start anywhere in a 128-row block. The weight is q * scale. How the experts are multiplied:
- CPU, steps of up to CpuEightBitExperts.MAX_TOKENS tokens (decode): kernels/moe.c reads only the chosen
  experts' bytes and widens them in registers, times their scales (float32 or bf16 activations).
- CUDA: the Triton grouped matmuls of kernels/triton_moe.py, which widen the bytes in registers too.
- Longer CPU steps (prefill), and anything else: the experts some token chose, and only those, are
  dequantized for the call (DequantizingExperts) and multiplied by torch's grouped matmul; dropped after.
In float32 every path computes with float32(q * scale), the weight a float32 dequantization holds.
"""
from __future__ import annotations

import torch
from torch import nn

from services.model_worker.config.quantization import FP8_BLOCK
from services.model_worker.kernels import cpu_moe, triton_moe
from services.model_worker.model.layers.fused_moe import ExpertsKernel, ExpertsMethod, FusedMoE, TorchGroupedExperts
from services.model_worker.model.layers.quant.quantize import RowScales, quantize_fp8_blocks, quantize_int8

# Experts quantized at a time on load: bounds the float32 copy quantizing makes (about 64 MB here).
_CHUNK_ELEMENTS = 1 << 24


def dequantize_experts(q: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """(E', N, K) 8-bit experts and their (E', N, ceil(K / block)) scales as q * scale in float32, then dtype."""
    k = q.shape[-1]
    per_element = scales if block == k else scales.repeat_interleave(block, -1)[..., :k]
    return (q.float() * per_element).to(dtype)


class DequantizingExperts:
    """The chosen experts dequantized for this call only, then `inner` (a kernel for plain weights) on them.

    Reads the chosen experts' bytes and no others; the copy (model dtype) lives for the call. Finding the
    chosen experts reads the routing back to the host, so a CUDA graph cannot capture this path."""

    name = "dequantize-chosen"

    def __init__(self, inner: ExpertsKernel | None = None):
        self.inner = inner or TorchGroupedExperts()

    def __call__(self, x: torch.Tensor, moe: FusedMoE, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        chosen = torch.unique(ids)
        compact = torch.zeros(moe.num_experts, dtype=ids.dtype, device=ids.device)
        compact[chosen] = torch.arange(chosen.numel(), dtype=ids.dtype, device=ids.device)
        w13 = dequantize_experts(moe.w13[chosen], moe.w13_scale[chosen], moe.block13, x.dtype)
        w2 = dequantize_experts(moe.w2[chosen], moe.w2_scale[chosen], moe.block2, x.dtype)
        return self.inner(x, w13, w2, weights, compact[ids])


class CpuEightBitExperts:
    """kernels/moe.c's 8-bit entry for decode-sized steps; longer ones dequantize the chosen experts."""

    name = "cpu-c-8bit"
    MAX_TOKENS = 32  # as CpuExperts: past this many rows a blocked matmul on a dequantized copy wins

    def __init__(self, library):
        self.library = library
        self.fallback = DequantizingExperts()

    def __call__(self, x, moe, weights, ids):
        if x.shape[0] > self.MAX_TOKENS or x.dtype not in (torch.float32, torch.bfloat16):
            return self.fallback(x, moe, weights, ids)
        return cpu_moe.moe_experts_q8(self.library, x, moe.w13, moe.w13_scale, moe.block13, moe.w2, moe.w2_scale,
                                      moe.block2, weights, ids)


class TritonEightBitExperts:
    """The Triton grouped matmuls on the bytes (GPU): nothing read back to the host, so CUDA graphs capture it."""

    name = "triton-8bit"

    def __call__(self, x, moe, weights, ids):
        return triton_moe.fused_moe(x, moe.w13, moe.w2, weights, ids,
                                    (moe.w13_scale, moe.block13, moe.w2_scale, moe.block2))


class EightBitExpertsMethod(ExpertsMethod):
    """fmt "fp8" or "int8"; from_checkpoint: the checkpoint holds fp8 experts and their block scales (Qwen's
    FP8 MoE checkpoints), else the experts load in the model dtype and are quantized once loaded."""

    def __init__(self, fmt: str, from_checkpoint: bool):
        if fmt not in ("fp8", "int8") or (from_checkpoint and fmt != "fp8"):
            raise ValueError(f"no 8-bit experts format {fmt!r}{' in checkpoints' if from_checkpoint else ''}")
        self.fmt, self.from_checkpoint = fmt, from_checkpoint
        self.name = f"{fmt}-{'checkpoint' if from_checkpoint else 'quantized-on-load'}"

    def create_weights(self, moe, hidden_size):
        if not self.from_checkpoint:
            super().create_weights(moe, hidden_size)  # quantized after loading
            return
        block = FP8_BLOCK[1]
        local, size = moe.intermediate_size, moe.tp.size
        if size > 1 and local % block:
            # down_proj's inputs are split between the ranks: a 128-wide block would straddle two of them.
            raise ValueError(
                f"fp8 experts cannot be split across {size} tensor-parallel ranks: each rank's share of "
                f"moe_intermediate_size ({local * size} / {size} = {local}) must be a multiple of the {block}-wide "
                f"fp8 blocks; use a tensor-parallel size that splits it into whole blocks")
        e = moe.num_experts

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        moe.w13 = param(e, 2 * local, hidden_size, dtype=torch.float8_e4m3fn)
        moe.w2 = param(e, hidden_size, local, dtype=torch.float8_e4m3fn)
        moe.w13_scale = param(e, 2 * local, -(-hidden_size // block), dtype=torch.float32)
        moe.w2_scale = param(e, hidden_size, -(-local // block), dtype=torch.float32)

    def checkpoint_tensor(self, moe, leaf, source, rows):
        # A checkpoint's scales are per block of 128 rows; the experts hold one row of them per weight row.
        return RowScales(source, FP8_BLOCK[0], rows) if leaf.endswith("_scale") else source

    def process_weights_after_loading(self, moe):
        if not self.from_checkpoint:
            w13, s13 = self._quantize(moe, moe.w13.detach(), split=2, tp=None)
            # down_proj's rows are split between the ranks (its inputs): int8 takes each row's amax over all.
            w2, s2 = self._quantize(moe, moe.w2.detach(), split=1, tp=moe.tp if moe.tp.size > 1 else None)
            moe.w13, moe.w2 = (nn.Parameter(w, requires_grad=False) for w in (w13, w2))
            moe.w13_scale, moe.w2_scale = (nn.Parameter(s, requires_grad=False) for s in (s13, s2))
        moe.block13 = FP8_BLOCK[1] if self.fmt == "fp8" else moe.w13.shape[2]
        moe.block2 = FP8_BLOCK[1] if self.fmt == "fp8" else moe.w2.shape[2]
        moe.kernel = pick_eight_bit_kernel(moe)

    def apply(self, moe, x, weights, ids):
        return moe.kernel(x, moe, weights, ids)

    def _quantize(self, moe, weight: torch.Tensor, split: int, tp) -> tuple[torch.Tensor, torch.Tensor]:
        """(E, N, K) weights to 8 bits and per-row scales: int8 one scale a row; fp8 each expert's parts
        (gate and up apart: split 2) in 128 x 128 blocks of their own, as a checkpoint holds them."""
        e, n, k = weight.shape
        if self.fmt == "int8":
            chunk = max(1, _CHUNK_ELEMENTS // (n * k))
            qs, scales = [], []
            for start in range(0, e, chunk):  # the same chunks on every rank: each all_max is matched
                q, s = quantize_int8(weight[start:start + chunk].reshape(-1, k), tp)
                qs.append(q.view(-1, n, k))
                scales.append(s.view(-1, n, 1))
            return torch.cat(qs).to(weight.device), torch.cat(scales).to(weight.device)
        q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=weight.device)
        scales = torch.empty(e, n, -(-k // FP8_BLOCK[1]), dtype=torch.float32, device=weight.device)
        rows = n // split
        for expert in range(e):
            for part in range(split):
                span = slice(part * rows, (part + 1) * rows)
                part_q, block_scales = quantize_fp8_blocks(weight[expert, span])
                q[expert, span] = part_q
                scales[expert, span] = block_scales.repeat_interleave(FP8_BLOCK[0], 0)[:rows]
        return q, scales


def pick_eight_bit_kernel(moe: FusedMoE):
    """The C kernel on a CPU, Triton on a GPU, a per-call dequantization of the chosen experts otherwise."""
    if moe.w13.device.type == "cpu" and cpu_moe.supports_q8(moe.w13, moe.w2):
        library = cpu_moe.load()
        if library is not None:
            return CpuEightBitExperts(library)
    if moe.w13.device.type == "cuda" and triton_moe.available():
        return TritonEightBitExperts()
    return DequantizingExperts()


def experts_method(linear) -> ExpertsMethod | None:
    """The experts' format matching the linear layers' method: 8-bit experts for 8-bit layers, else None (plain).

    Duck-typed on the 8-bit linear method's `fmt` and `from_checkpoint`, so this module needs nothing of it."""
    fmt = getattr(linear, "fmt", None)
    if fmt not in ("fp8", "int8"):
        return None
    return EightBitExpertsMethod(fmt, bool(getattr(linear, "from_checkpoint", False)))
