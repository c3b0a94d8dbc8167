"""Qwen3 checkpoint configuration: config.json and generation_config.json, read and checked."""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any

from checkpoint.files import eos_token_ids, read_json
from services.model_worker.config.quantization import QuantizationError, checkpoint_quantization

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "yarn")


class ConfigError(ValueError):
    """A checkpoint's configuration is missing, unsupported or inconsistent."""


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # Normalised rope scaling: None, or a dict with "rope_type" == "yarn" and its parameters.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    attention_bias: bool = False
    architecture: str = "Qwen3ForCausalLM"
    # Mixture of experts (Qwen3MoeForCausalLM); zero experts: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1

    # config.json's quantization_config: None, or Qwen's FP8 format (config/quantization.py checks it).
    quantization_config: dict[str, Any] | None = None

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` has experts (the reference's rule) rather than a dense MLP."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def __post_init__(self) -> None:
        try:
            checkpoint_quantization(self.quantization_config)
        except QuantizationError as e:
            raise ConfigError(str(e)) from None
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}: this engine implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} only")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"config.json: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ConfigError(f"config.json: rope_theta must be positive, got {self.rope_theta}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"config.json: rope scaling type {kind!r} is not supported; "
                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            if kind == "default":
                self.rope_scaling = None
            elif not self.rope_scaling.get("factor"):
                raise ConfigError("config.json: yarn rope scaling needs a positive 'factor'")
        if self.architecture in MOE_ARCHITECTURES:
            self._check_experts()

    def _check_experts(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config.json: {name} must be a positive integer for {self.architecture}, "
                                  f"got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                              f"({self.num_experts})")
        self.mlp_only_layers = tuple(self.mlp_only_layers)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Qwen3Config":
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else (
            {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(raw.get("model_type"))
            or repr(raw.get("model_type")))
        if architecture not in SUPPORTED_ARCHITECTURES:
            # Fail here, before a missing Qwen3-only field hides the real problem.
            raise ConfigError(
                f"unsupported architecture {architecture}: this engine implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} only")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise ConfigError(f"config.json is missing {', '.join(missing)}")
        # transformers 5 writes rope_parameters {"rope_theta", "rope_type", ...};
        # published Qwen3 checkpoints use top-level rope_theta and rope_scaling.
        rope_parameters = dict(raw.get("rope_parameters") or {})
        rope_theta = rope_parameters.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
        scaling = dict(raw.get("rope_scaling") or {})
        if rope_parameters.get("rope_type", "default") != "default":
            scaling = {**rope_parameters, **scaling}
        if scaling:
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            scaling.pop("rope_theta", None)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling or None,
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            attention_bias=bool(raw.get("attention_bias", False)),
            architecture=architecture,
            **(_expert_fields(raw) if architecture in MOE_ARCHITECTURES else {}),
            quantization_config=raw.get("quantization_config") or None,
        )

    @classmethod
    def from_json(cls, path: str | pathlib.Path) -> "Qwen3Config":
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)


def _expert_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts keys; transformers 5 writes num_experts as num_local_experts."""
    return dict(num_experts=raw.get("num_experts", raw.get("num_local_experts", 0)),
                num_experts_per_tok=raw.get("num_experts_per_tok", 0),
                moe_intermediate_size=raw.get("moe_intermediate_size", 0),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
                decoder_sparse_step=raw.get("decoder_sparse_step", 1))


@dataclass
class GenerationDefaults:
    """generation_config.json: eos ids and the sampling defaults a request inherits."""

    eos_token_ids: list[int] = field(default_factory=list)
    # Only the keys the file sets; SamplingParams.resolve applies them.
    sampling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, checkpoint_dir: str | pathlib.Path) -> "GenerationDefaults":
        raw = read_json(pathlib.Path(checkpoint_dir) / "generation_config.json")
        keys = ("do_sample", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return cls(eos_token_ids=eos_token_ids(checkpoint_dir),
                   sampling={k: raw[k] for k in keys if raw.get(k) is not None})
