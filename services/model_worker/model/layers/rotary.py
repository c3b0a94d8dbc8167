"""Rotary position embedding (RoPE), with YaRN scaling where the config asks for it."""
from __future__ import annotations

import math

import torch
from torch import nn

from services.model_worker.config.model import Qwen3Config


def rotary_inv_freq(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale (1.0 without YaRN)."""
    dim, base = config.head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    # YaRN (arXiv 2309.00071): interpolate low frequencies, keep high ones, blend in between.
    factor = float(scaling["factor"])
    original_max = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        # Not in the checkpoint: derived from the config, kept in float32 and cast per call.
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # (cos | cos) and (-sin | sin), whole rows in the step's dtype, by (dtype, device): a step looks its
        # positions up in them with one index each, where building them per step took eight small ops.
        self._rows: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables on this module's device; the loader calls it after building on 'meta'."""
        device = self.cos.device
        if device.type == "meta":
            return
        inv_freq, scale = rotary_inv_freq(self.config)
        positions = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq.cpu()).to(device)
        self.cos = freqs.cos() * scale
        self.sin = freqs.sin() * scale
        self._rows.clear()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, cos) and (-sin, sin) at the tokens' positions, (T, 1, D) each, for _rotate.

        Looked up once per step and shared by all layers.
        """
        rows = self._rows.get((dtype, self.cos.device))
        if rows is None:
            # Rounding to dtype is the same elementwise before the lookup as after it, and rounds -x to -(x
            # rounded): these rows equal what the lookup then the concatenation gave, bit for bit.
            rows = (torch.cat((self.cos, self.cos), dim=-1).to(dtype),
                    torch.cat((-self.sin, self.sin), dim=-1).to(dtype))
            self._rows[(dtype, self.cos.device)] = rows
        cos, signed_sin = rows
        return cos.index_select(0, positions).unsqueeze(1), signed_sin.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: (T, heads, D). Half-split rotation ("rotate_half"), not interleaved pairs.

    (x1 cos - x2 sin, x2 cos + x1 sin) with the sign folded into the table: four ops, rounding
    exactly as written out.
    """
    cos, signed_sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin
