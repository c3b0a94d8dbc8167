"""Random PEFT LoRA adapters written by peft on a checkpoint from tests/checkpoints.py, with a greedy reference."""
from __future__ import annotations

import pathlib

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(checkpoint: pathlib.Path, out: pathlib.Path, rank: int = 8, target_modules=None, seed: int = 0,
                 lora_alpha: int = 16, use_rslora: bool = False, std: float = 0.1, **config):
    """Save a LoRA adapter with random, non-zero A and B (peft's own format and names); return the peft model
    (float32), the reference the engine is tested against."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3ForCausalLM

    base = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    lora = LoraConfig(r=rank, lora_alpha=lora_alpha, target_modules=target_modules or ALL_MODULES,
                      use_rslora=use_rslora, init_lora_weights=False, lora_dropout=0.0, **config)
    model = get_peft_model(base, lora).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    model.save_pretrained(out)
    return model


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens by full forwards of the model (no cache, no generate() settings in the way)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
