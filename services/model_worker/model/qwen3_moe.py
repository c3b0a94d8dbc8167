"""Qwen3's mixture-of-experts models (Qwen3MoeForCausalLM): the dense model's attention, norms and rotary,
with a sparse MoE block in place of the MLP in the layers the config names."""
from __future__ import annotations

import re

import torch
from torch import nn

from services.model_worker.config.model import Qwen3Config
from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.model.layers.fused_moe import EXPERT_PARTS, FUSED_PARTS, FusedMoE
from services.model_worker.model.layers.linear import LinearMethod, ReplicatedLinear
from services.model_worker.model.layers.quant.experts import experts_method
from services.model_worker.model.qwen3 import Qwen3ForCausalLM

# model.layers.N.mlp.experts.E.gate_proj.weight (published; FP8 checkpoints add .weight_scale_inv beside it)
# and model.layers.N.mlp.experts.gate_up_proj (3-D).
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
# Our parameter for each per-expert checkpoint tensor kind, and back.
_LEAF_SUFFIX = {"weight": "", "weight_scale_inv": "_scale"}
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class Qwen3MoeSparseMoeBlock(nn.Module):
    """The router (`gate`, whole on every rank) and the experts; the names are the checkpoint's."""

    def __init__(self, config: Qwen3Config, tp: TensorParallel, linear: LinearMethod | None = None):
        """linear: the decoder's linear method; 8-bit layers get 8-bit experts of the same format."""
        super().__init__()
        # The router stays in plain F.linear: E outputs is too narrow for the packed or C formats to matter.
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, config.norm_topk_prob, tp, experts_method(linear))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """The dense model's classes and weight names (q/k/v and dense gate/up fused as there), plus the experts'."""

    @staticmethod
    def make_mlp(config: Qwen3Config, tp: TensorParallel, linear: LinearMethod | None):
        """Experts in the layers the config makes sparse, the dense MLP (with `linear`) in the others."""
        return lambda index: Qwen3MoeSparseMoeBlock(config, tp, linear) if config.is_moe_layer(index) else None

    def checkpoint_target(self, name: str) -> tuple[nn.Module, str, object] | None:
        """The experts module, its parameter and the shard for an expert tensor; None for any other name."""
        if match := _PER_EXPERT.match(name):
            module_path, expert, part, kind = match.groups()
            leaf, index = EXPERT_PARTS[part]
            leaf += _LEAF_SUFFIX[kind]
            module = self._experts(module_path)
            if module is None or int(expert) >= module.num_experts or not hasattr(module, leaf):
                return None
            return module, leaf, (int(expert), index)
        if match := _FUSED.match(name):
            module = self._experts(match.group(1))
            return None if module is None else (module, FUSED_PARTS[match.group(2)], None)
        return None

    def checkpoint_names(self, parameter: str) -> list[str] | None:
        """The published per-expert names that fill an experts parameter; None for any other parameter."""
        module_path, _, leaf = parameter.rpartition(".")
        if leaf not in ("w13", "w2", "w13_scale", "w2_scale") or not isinstance(self._experts(module_path), FusedMoE):
            return None
        parts = ("gate_proj", "up_proj") if leaf.startswith("w13") else ("down_proj",)
        kind = "weight_scale_inv" if leaf.endswith("_scale") else "weight"
        return [f"{module_path}.{e}.{part}.{kind}" for e in range(self.config.num_experts) for part in parts]

    def checkpoint_covers(self, name: str) -> list[str]:
        """The per-expert names a checkpoint tensor stands for (a fused 3-D tensor: every expert's)."""
        if match := _FUSED.match(name):
            module_path, part = match.groups()
            return self.checkpoint_names(f"{module_path}.{FUSED_PARTS[part]}") or [name]
        return [name]

    def _experts(self, module_path: str) -> FusedMoE | None:
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None
        return module if isinstance(module, FusedMoE) else None
