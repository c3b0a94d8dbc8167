"""Qwen3 (Qwen3ForCausalLM) built by hand: layer and parameter names follow the reference checkpoints."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.attention import AttentionMetadata, paged_attention
from services.model_worker.config import Qwen3Config
from services.model_worker.kernels import cpu_norm
from services.model_worker.parallel import TensorParallel, VocabParallelEmbedding

# Checkpoint tensors that our fused parameters are made of: (checkpoint name part, our name part, shard).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

# Under tensor parallelism, the dim along which each module's weight is split across ranks: 0 for
# column-parallel (each rank computes some outputs), 1 for row-parallel (each rank sums part of the
# inputs; its bias is added by rank 0 alone). Modules not named here are whole on every rank.
TP_SPLIT_DIMS = {
    "qkv_proj": 0,
    "gate_up_proj": 0,
    "o_proj": 1,
    "down_proj": 1,
    "embed_tokens": 0,
    "lm_head": 0,
}


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

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, cos) and (-sin, sin) at the tokens' positions, (T, 1, D) each, for _rotate.

        Looked up once per step and shared by all layers.
        """
        cos = self.cos[positions].to(dtype)[:, None, :]  # (T, 1, D/2)
        sin = self.sin[positions].to(dtype)[:, None, :]
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: (T, heads, D). Half-split rotation ("rotate_half"), not interleaved pairs.

    (x1 cos - x2 sin, x2 cos + x1 sin) with the sign folded into the table: four ops, rounding
    exactly as written out.
    """
    cos, signed_sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


def norm_and_rotate(x: torch.Tensor, weight: torch.Tensor, eps: float, rope: tuple[torch.Tensor, torch.Tensor],
                    kernel=None) -> torch.Tensor:
    """rms_norm then apply_rotary on (T, heads, D): one C call where the kernel takes the layout."""
    if kernel is not None and cpu_norm.supports_rope(x, weight, rope):
        return cpu_norm.rms_norm_rope(kernel, x, weight, eps, rope)
    return apply_rotary(rms_norm(x, weight, eps, kernel), rope)


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        # This rank's heads: q and kv heads split alike, so each rank's queries find their KV heads locally.
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = config.num_key_value_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self._qk_weight: tuple[tuple, torch.Tensor] | None = None

    def qk_norm_weight(self) -> torch.Tensor:
        """q_norm's weight for each q head, then k_norm's for each kv head: (H + Hkv, D).

        Built once and reused: three ops a layer a step otherwise. Rebuilt when either weight is
        replaced (a move to another device or dtype); weights are loaded before the first forward
        and not written after it (inference tensors keep no version counter to tell).
        """
        q, k = self.q_norm.weight, self.k_norm.weight
        key = (q.data_ptr(), k.data_ptr(), q.dtype, q.device)
        if self._qk_weight is None or self._qk_weight[0] != key:
            weight = torch.cat((q.detach().expand(self.num_heads, -1), k.detach().expand(self.num_kv_heads, -1)))
            self._qk_weight = (key, weight)
        return self._qk_weight[1]

    def shard_slice(self, shard: str) -> slice:
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        return slice(start, start + (self.q_size if shard == "q" else self.kv_size))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # The q and k heads are normalised and rotated as one tensor (T, H + Hkv, D): the norm is
        # per head anyway, each with q_norm's or k_norm's weight; half the ops of doing them apart.
        qk = norm_and_rotate(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim),
                             self.qk_norm_weight(), self.q_norm.eps, rope, self.q_norm.kernel)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.reshape(tokens, self.q_size)))


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size, bias=False)

    def shard_slice(self, shard: int) -> slice:
        return slice(shard * self.intermediate_size, (shard + 1) * self.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel):
        super().__init__()
        self.self_attn = Qwen3Attention(config, tp)
        self.mlp = Qwen3MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, rope, k_cache, v_cache, meta):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, k_cache, v_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # bf16 on CPU: every layer of a decode step in one C call where it applies (fused_decode.py).
        self.fused_decode = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        if self.fused_decode is not None and self.fused_decode.takes(hidden, meta):
            self.fused_decode(hidden, rope, kv_caches, meta)  # the same layers, in place, in one call
            return self.norm(hidden)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden = layer(hidden, rope, k_cache, v_cache, meta)
        return self.norm(hidden)


class Qwen3ForCausalLM(nn.Module):
    packed_modules = PACKED_MODULES
    tp_split_dims = TP_SPLIT_DIMS

    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None):
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.model = Qwen3Model(config, tp)
        # Split by vocabulary like the embedding, so a tied head shares this rank's slice of it.
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // tp.size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,) flat over the batch. Returns final hidden states (T, hidden)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(rows, vocab) on rank 0, which samples; None on the other ranks, which only send their slice."""
        # Callers pass only the rows whose next token is wanted: the vocab projection is the costliest matmul.
        return self.tp.gather_logits(self.lm_head(hidden))
