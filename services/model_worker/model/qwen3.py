"""Qwen3 (Qwen3ForCausalLM) built by hand: layer and parameter names follow the reference checkpoints."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.config.model import Qwen3Config
from services.model_worker.kernels import cpu_decoder
from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.model.layers.attention.dispatch import paged_attention
from services.model_worker.model.layers.attention.kv_quant import scales_of
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from services.model_worker.model.layers.embedding import VocabParallelEmbedding
from services.model_worker.model.layers.linear import (ColumnParallelLinear, LinearMethod, MergedColumnParallelLinear,
                                                       QKVParallelLinear, RowParallelLinear)
from services.model_worker.model.layers.norm import RMSNorm, norm_and_rotate
from services.model_worker.model.layers.rotary import RotaryEmbedding

# Checkpoint tensors that our fused parameters are made of: (checkpoint name part, our name part, shard).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel, linear: LinearMethod | None = None):
        super().__init__()
        # This rank's heads: q and kv heads split alike, so each rank's queries find their KV heads locally.
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = config.num_key_value_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, config.attention_bias, linear, tp)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        config.attention_bias, linear, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self._qk_weight: tuple[tuple, torch.Tensor] | None = None
        # An fp8 KV cache's per-layer scales: the checkpoint's self_attn.k_scale / v_scale where it has them
        # (the loader fills these), else 1.0. The cache keeps its own copies (executor/kv_cache.py).
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def reset_buffers(self) -> None:
        """1.0 for a checkpoint without KV cache scales (called after the model is materialised)."""
        self.k_scale.fill_(1.0)
        self.v_scale.fill_(1.0)

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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None, **scales) -> torch.Tensor:
        """scales: an 8-bit cache's k_scale and v_scale (kv_quant.LayerCache.scales); none for the model's dtype.
        rows: project only these rows' outputs (every row's keys and values still go to the cache)."""
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # The q and k heads are normalised and rotated as one tensor (T, H + Hkv, D): the norm is
        # per head anyway, each with q_norm's or k_norm's weight; half the ops of doing them apart.
        qk = norm_and_rotate(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim),
                             self.qk_norm_weight(), self.q_norm.eps, rope, self.q_norm.kernel)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, **scales).reshape(tokens, self.q_size)
        if rows is not None:
            out = out.index_select(0, rows)
            if not rows.numel():  # no row is wanted: the keys and values written were all this layer was for
                return x.new_empty(0, x.shape[-1])
        return self.o_proj(out)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel, linear: LinearMethod | None = None):
        super().__init__()
        self.intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, False,
                                                       linear, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, False, linear, tp)
        # The C activation (kernels/decoder.c silu_and_mul) where the executor enabled it; None: torch ops.
        self.act_kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.silu_and_mul(x)  # matmul and activation in one kernel, where there is one
        if act is not None:
            return self.down_proj(act)
        gate_up = self.gate_up_proj(x)
        if self.act_kernel is not None and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 \
                and gate_up.device.type == "cpu" and gate_up.is_contiguous():
            # One pass instead of SiLU and product apart (a new tensor each): 128 prompt tokens of the
            # 0.6B model spent 19 ms in those two ops over 28 layers.
            act = cpu_decoder.silu_and_mul(self.act_kernel, gate_up)
            if act is not None:
                return self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel, linear: LinearMethod | None = None,
                 mlp: nn.Module | None = None):
        """mlp: the feed-forward block in place of the dense one (a mixture of experts, model/qwen3_moe.py)."""
        super().__init__()
        self.self_attn = Qwen3Attention(config, tp, linear)
        self.mlp = mlp if mlp is not None else Qwen3MLP(config, tp, linear)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, rope, k_cache, v_cache, meta, rows: torch.Tensor | None = None, **scales):
        """rows: the rows to return, (K,) int64 ascending; every row's keys and values still go to the cache, but
        the output projection and MLP run on these alone. None: every row."""
        attn = self.self_attn(self.input_layernorm(hidden), rope, k_cache, v_cache, meta, rows, **scales)
        if rows is not None and not rows.numel():
            return attn  # (0, hidden)
        hidden = (hidden if rows is None else hidden.index_select(0, rows)) + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, tp: TensorParallel, linear: LinearMethod | None = None,
                 make_mlp=None):
        """make_mlp(index): layer index's feed-forward block, or None for the dense MLP."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, tp, linear, make_mlp(i) if make_mlp else None)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        # bf16 on CPU: every layer of a decode step (on VNNI weights, of any step) in one C call where it
        # applies (fused_decode.py).
        self.fused_decode = None
        # LoRA's step state (model/lora/slots.py LoraState) where adapters are enabled: the fused loop adds the
        # adapter rows' products as the layers do, where lora.c builds; else those steps run layer by layer.
        self.lora = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb(positions, hidden.dtype)
        adapters = self.lora is not None and self.lora.batch is not None
        # The rows whose final hidden states the step reads (meta.output_rows): the last layer's output projection
        # and MLP need run on those alone, the others' keys and values being all later steps read of them. Not
        # with adapter rows, whose products the layers add by the step's row order.
        keep = None if adapters else meta.output_rows
        fused = self.fused_decode
        if fused is not None and (not adapters or fused.takes_lora()) and (
                fused.takes(hidden, meta) or fused.takes_prompts(hidden, meta)):
            self.fused_decode(hidden, rope, kv_caches, meta, keep)  # the same layers, in place, in one call
            return self.norm(hidden)
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if i == last and keep is not None:
                # The other rows keep the layer before's states: undefined, as the fused loop leaves them.
                kept = layer(hidden, rope, *cache, meta, keep, **scales_of(cache))
                return self.norm(hidden.index_copy(0, keep, kept))
            hidden = layer(hidden, rope, *cache, meta, **scales_of(cache))
        return self.norm(hidden)


class Qwen3ForCausalLM(nn.Module):
    packed_modules = PACKED_MODULES
    # False for a bare decoder saved without its head (an embedding checkpoint): it pools, never samples.
    has_lm_head = True

    def __init__(self, config: Qwen3Config, tp: TensorParallel | None = None, linear: LinearMethod | None = None):
        """linear: how every linear layer holds and multiplies its weights (model/layers/linear.py)."""
        super().__init__()
        self.config = config
        self.tp = tp = tp or TensorParallel()
        self.model = Qwen3Model(config, tp, linear, self.make_mlp(config, tp, linear))
        # Split by vocabulary like the embedding, so a tied head shares this rank's slice of it; the
        # ranks' slices of the logits are gathered in compute_logits, not in the layer.
        self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, False, linear, tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_mlp(config: Qwen3Config, tp: TensorParallel, linear: LinearMethod | None):
        """The per-layer feed-forward factory for Qwen3Model; None: dense MLPs everywhere."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (T,) flat over the batch. Returns final hidden states (T, hidden)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(rows, vocab) on rank 0, which samples; None on the other ranks, which only send their slice."""
        # Callers pass only the rows whose next token is wanted: the vocab projection is the costliest matmul.
        return self.tp.gather_logits(self.lm_head(hidden))
