"""Random Qwen3 checkpoints written by transformers, the independent reference the engine is tested against."""
from __future__ import annotations

import json
import pathlib

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=True,
            # Large enough that greedy continuations vary instead of repeating one token.
            initializer_range=0.3)


def make_checkpoint(path: pathlib.Path, seed: int = 0, max_shard_size: str | None = None,
                    rope_spelling: str = "rope_parameters", eos_token_id=(1, 2), generation: dict | None = None,
                    **overrides):
    """Save a random Qwen3ForCausalLM (float32) with transformers; return the reference model.

    rope_spelling "rope_parameters" keeps transformers 5's format; "rope_theta" rewrites
    config.json with the top-level rope_theta of the published Qwen3 checkpoints.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {**TINY, **overrides}
    rope_scaling = fields.pop("rope_scaling", None)
    torch.manual_seed(seed)
    config = Qwen3Config(**fields, dtype="float32")
    if rope_scaling:
        config.rope_parameters = {"rope_theta": fields["rope_theta"], **rope_scaling}
    model = Qwen3ForCausalLM(config).eval()
    # Non-trivial norm weights, so a bug that skips a norm cannot hide behind ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    raw = json.loads((path / "config.json").read_text())
    if rope_spelling == "rope_theta":
        params = raw.pop("rope_parameters", None) or {}
        raw["rope_theta"] = params.pop("rope_theta", fields["rope_theta"])
        if params.get("rope_type", "default") != "default":
            raw["rope_scaling"] = params
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    gen = {"eos_token_id": list(eos_token_id), **(generation or {})}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return model
