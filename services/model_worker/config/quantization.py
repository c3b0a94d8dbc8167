"""8-bit weights: the checkpoint's quantization_config and the --quantization flag, checked and resolved to one scheme."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_CHOICES = ("none", "fp8", "int8")
# Qwen's published FP8 checkpoints (Qwen/Qwen3-*-FP8): e4m3 weights, one scale per 128 x 128 block.
FP8_BLOCK = (128, 128)


class QuantizationError(ValueError):
    """A quantization the engine does not implement, or flags that contradict the checkpoint."""


@dataclass(frozen=True)
class QuantScheme:
    """How the linear layers' weights are held.

    method: "fp8" (float8_e4m3fn, one float32 scale per block) or "int8" (symmetric, one scale per
    output row). from_checkpoint: the checkpoint already holds them (weight + weight_scale_inv);
    otherwise the bf16/fp32 weights are quantized when they load. lm_head: the vocab projection too.
    """

    method: str
    from_checkpoint: bool
    lm_head: bool


def checkpoint_quantization(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """config.json's quantization_config, checked: None, or Qwen's FP8 block format. Raises QuantizationError."""
    if not raw:
        return None
    method = raw.get("quant_method")
    if method != "fp8":
        raise QuantizationError(
            f"config.json: quantization_config quant_method {method!r} is not supported; this engine loads "
            "'fp8' checkpoints (e4m3 weights with 128x128 block scales, as Qwen publishes) and quantizes bf16 "
            "checkpoints itself with --quantization fp8 or int8")
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"config.json: fp8 format {fmt!r} is not supported; only e4m3 (float8_e4m3fn)")
    block = raw.get("weight_block_size")
    if block is None or list(block) != list(FP8_BLOCK):
        raise QuantizationError(
            f"config.json: fp8 weight_block_size {block!r} is not supported; only {list(FP8_BLOCK)} "
            "(per-tensor or per-channel fp8 checkpoints are not)")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(f"config.json: fp8 activation_scheme {scheme!r} is not supported; only 'dynamic'")
    # What may stay unconverted is what this engine keeps in bf16 anyway: the head, and a mixture-of-experts
    # router (`model.layers.N.mlp.gate`, which Qwen's FP8 MoE checkpoints list layer by layer).
    skipped = [m for m in raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
               if m != "lm_head" and not m.endswith("mlp.gate")]
    if skipped:
        raise QuantizationError(f"config.json: fp8 modules_to_not_convert {skipped} is not supported: every "
                                "linear layer but lm_head and the routers (mlp.gate) must be fp8")
    return dict(raw)


def resolve_scheme(checkpoint: dict[str, Any] | None, flag: str, quantize_lm_head: bool) -> QuantScheme | None:
    """The scheme from the checkpoint and --quantization / --quantize-lm-head; None: plain weights."""
    if flag not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {flag!r}")
    if checkpoint is not None:
        if flag == "int8":
            raise QuantizationError("--quantization int8: the checkpoint is already fp8; serve it as fp8 "
                                    "(--quantization none or fp8)")
        return QuantScheme("fp8", from_checkpoint=True, lm_head=quantize_lm_head)
    if flag == "none":
        if quantize_lm_head:
            raise QuantizationError("--quantize-lm-head needs --quantization fp8 or int8 (or an fp8 checkpoint)")
        return None
    return QuantScheme(flag, from_checkpoint=False, lm_head=quantize_lm_head)
