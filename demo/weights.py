"""Random, seeded Qwen3 weights under Hugging Face's tensor names, written as model.safetensors."""

from pathlib import Path

import torch
from safetensors.torch import save_file

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def qwen3_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of Qwen3ForCausalLM by name; Linear weights are (out_features, in_features)."""
    hidden = config["hidden_size"]
    intermediate = config["intermediate_size"]
    head_dim = config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim

    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            # Qwen3 normalizes each head's queries and keys before RoPE.
            f"{layer}.self_attn.q_norm.weight": (head_dim,),
            f"{layer}.self_attn.k_norm.weight": (head_dim,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (intermediate, hidden),
            f"{layer}.mlp.up_proj.weight": (intermediate, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, intermediate),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def random_weights(config: dict, dtype: str, seed: int) -> dict[str, torch.Tensor]:
    """Norm scales of 1 and normal(0, initializer_range) elsewhere, as HF initializes Qwen3."""
    generator = torch.Generator().manual_seed(seed)
    std = config["initializer_range"]
    tensors = {}
    for name, shape in qwen3_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=DTYPES[dtype])
        else:
            # Drawn in float32 and cast one tensor at a time, so the extra memory is one tensor's worth
            # and the values do not depend on the output dtype's sampling path.
            drawn = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            tensors[name] = drawn.to(DTYPES[dtype])
    return tensors


def write_random_weights(path: Path, config: dict, dtype: str, seed: int) -> Path:
    # save_file writes straight from the tensors' memory, so the peak stays at about one model copy.
    save_file(random_weights(config, dtype, seed), str(path), metadata={"format": "pt"})
    # save_file creates the file owner-only; services in other containers or users must read it.
    path.chmod(0o644)
    return path
