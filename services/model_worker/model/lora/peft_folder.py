"""A PEFT LoRA folder read and checked: adapter_config.json and adapter_model.safetensors, nothing else."""
from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass

import torch

from services.model_worker.config.model import Qwen3Config

# The linear layers of a dense Qwen3 decoder layer an adapter may target, with where each sits.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter name}].weight
_TENSOR_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                          r"(?:\.[\w-]+)?\.weight")


class AdapterError(ValueError):
    """The folder cannot be served: the message says what is wrong with it."""


@dataclass
class PeftAdapter:
    path: str
    rank: int
    scaling: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # (layer index, module name) -> (A (r, in), B (out, r)), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def module_shapes(config: Qwen3Config) -> dict[str, tuple[int, int]]:
    """Each target module's (out, in) over the whole model (no tensor-parallel split)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def read_adapter(path: str | pathlib.Path, config: Qwen3Config, max_rank: int) -> PeftAdapter:
    """The adapter in a PEFT folder; AdapterError naming what is missing, malformed or beyond this worker."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise AdapterError(f"no adapter folder at {str(path)!r}")
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file():
        raise AdapterError(f"{folder} has no adapter_config.json: not a PEFT adapter folder")
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise AdapterError(f"{folder} holds adapter_model.bin only: pickled weights are never loaded (unpickling "
                               "can run code); save the adapter as adapter_model.safetensors "
                               "(save_pretrained(safe_serialization=True))")
        raise AdapterError(f"{folder} has no adapter_model.safetensors")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{config_file} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{config_file} is not a JSON object")
    rank, scaling, layers = _check_config(raw, config, max_rank)
    targets = _targets(raw.get("target_modules"), config)
    weights = _read_weights(weights_file, config, rank, targets, layers)
    return PeftAdapter(str(folder), rank, scaling, weights)


def _check_config(raw: dict, config: Qwen3Config, max_rank: int) -> tuple[int, float, set[int]]:
    """(rank, scaling, layers it may touch) from adapter_config.json; refuses what the kernels do not compute."""
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type is {peft_type!r}; only LORA adapters are served")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"the adapter's rank r={rank} is over this worker's --max-lora-rank {max_rank}")
    alpha = raw.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"bias {raw.get('bias')!r} is not served: only adapters with bias \"none\"")
    if raw.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {raw['modules_to_save']!r} is not served: an adapter that replaces "
                           "whole modules (a new head or embedding) needs a model of its own")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise AdapterError(f"{key} is not served: every module must have rank r and lora_alpha")
    for key in ("use_dora", "lora_bias"):
        if raw.get(key):
            raise AdapterError(f"{key} is not served")
    # fan_in_fan_out concerns how a merge transposes a Conv1D base weight; A and B are linear layers either
    # way, and the shapes are checked below.
    layers = raw.get("layers_to_transform")
    if layers is None:
        chosen = set(range(config.num_hidden_layers))
    else:
        chosen = {layers} if isinstance(layers, int) else set(layers) if isinstance(layers, list) else None
        if chosen is None or not all(isinstance(i, int) and 0 <= i < config.num_hidden_layers for i in chosen):
            raise AdapterError(f"layers_to_transform must be layer indices in [0, {config.num_hidden_layers}), "
                               f"got {layers!r}")
    return rank, float(scaling), chosen


def _targets(target_modules, config: Qwen3Config) -> set[str]:
    """The module names the config targets: a list of names, "all-linear", or a regex over module paths."""
    if target_modules == "all-linear":
        return set(TARGET_MODULES)
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise AdapterError(f"target_modules {target_modules!r} is not a valid regular expression: {e}") from None
        paths = [f"model.layers.{i}.{where}.{name}" for i in range(config.num_hidden_layers)
                 for name, where in TARGET_MODULES.items()]
        return {p.rsplit(".", 1)[1] for p in paths if pattern.fullmatch(p)}
    if not isinstance(target_modules, list) or not target_modules:
        raise AdapterError(f"target_modules must be a list of module names or a regex, got {target_modules!r}")
    names = {str(t).rsplit(".", 1)[-1] for t in target_modules}
    unknown = sorted(names - set(TARGET_MODULES))
    if unknown:
        raise AdapterError(f"target_modules {unknown} cannot be served: LoRA applies to "
                           f"{', '.join(TARGET_MODULES)} only")
    return names


def _read_weights(weights_file: pathlib.Path, config: Qwen3Config, rank: int, targets: set[str],
                  layers: set[int]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for name in f.keys():
                match = _TENSOR_NAME.fullmatch(name)
                if match is None:
                    raise AdapterError(f"{weights_file.name} holds {name!r}, which is no LoRA A or B weight of a "
                                       "decoder layer's linear module")
                layer, where, module, half = int(match[1]), match[2], match[3], match[4]
                if TARGET_MODULES.get(module) != where or module not in targets:
                    raise AdapterError(f"{name!r} is for {where}.{module}, which is not among the target modules "
                                       f"{sorted(targets)}")
                if layer not in layers:
                    raise AdapterError(f"{name!r} is for layer {layer}, outside the adapter's layers")
                halves.setdefault((layer, module), {})[half] = f.get_tensor(name)
    except SafetensorError as e:
        raise AdapterError(f"{weights_file} is not a readable safetensors file: {e}") from None
    if not halves:
        raise AdapterError(f"{weights_file} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        out_features, in_features = shapes[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise AdapterError(f"layer {layer} {module}: lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                               f"this model needs ({rank}, {in_features}) and ({out_features}, {rank})")
        weights[(layer, module)] = (a.float(), b.float())
    return weights
