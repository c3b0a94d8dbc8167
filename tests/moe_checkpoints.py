"""Random Qwen3MoeForCausalLM checkpoints written by transformers: the reference the MoE model is tested against."""
from __future__ import annotations

import json
import pathlib

import torch

TINY_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_theta=10000.0, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                tie_word_embeddings=True, initializer_range=0.3)


def make_moe_checkpoint(path: pathlib.Path, seed: int = 0, eos_token_id=(1, 2), max_shard_size: str | None = None,
                        **overrides):
    """Save a random Qwen3MoeForCausalLM (float32) with transformers; return the reference model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    fields = {**TINY_MOE, **overrides}
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**fields, dtype="float32")
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norm weights, so a skipped norm cannot hide behind ones
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):
                # A router initialised at zero (as transformers does) would tie every expert: spread it.
                p.normal_(0.0, 1.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos_token_id)}))
    return model
