"""An embedding checkpoint's Sentence Transformers files: its prompts, its pipeline's modules and pooling."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from checkpoint.files import read_json

# Sentence Transformers' older spelling of the pooling mode: one boolean key per mode, in the order its Pooling
# module concatenates them.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


class EmbeddingConfigError(ValueError):
    """A Sentence Transformers file of the checkpoint is malformed."""


@dataclass(frozen=True)
class EmbeddingConfig:
    """What the gateway needs of the Sentence Transformers files beside a checkpoint; empty when it has none."""

    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before each text input
    default_prompt_name: str = ""
    modules: list[str] = field(default_factory=list)  # modules.json's types, in order
    pooling_modes: list[str] = field(default_factory=list)

    @classmethod
    def from_dir(cls, checkpoint_dir: Path | str) -> "EmbeddingConfig":
        checkpoint_dir = Path(checkpoint_dir)
        settings = _read(checkpoint_dir, "config_sentence_transformers.json", dict)
        prompts = settings.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str | None) for v in prompts.values()):
            raise EmbeddingConfigError("config_sentence_transformers.json: `prompts` must map names to strings")
        prompts = {name: text or "" for name, text in prompts.items()}  # a null prompt is an empty one, as there
        default = settings.get("default_prompt_name") or ""
        if default and default not in prompts:
            raise EmbeddingConfigError(f"config_sentence_transformers.json: default_prompt_name {default!r} is not "
                                       f"one of its prompts ({', '.join(sorted(prompts)) or 'none'})")
        modules = _read(checkpoint_dir, "modules.json", list)
        if not all(isinstance(m, dict) and isinstance(m.get("type"), str) for m in modules):
            raise EmbeddingConfigError("modules.json: each module must be an object with a `type`")
        pooling = next((m for m in modules if m["type"].rsplit(".", 1)[-1] == "Pooling"), None)
        if pooling is None:
            return cls(prompts, default, [m["type"] for m in modules])
        config = _read(checkpoint_dir, f"{pooling.get('path') or '.'}/config.json", dict)
        return cls(prompts, default, [m["type"] for m in modules], pooling_modes(config))


def pooling_modes(config: dict) -> list[str]:
    """A Pooling module's modes from its config.json: `pooling_mode` (a name or a list), else the legacy
    booleans; "mean" when it names none, as Sentence Transformers takes it."""
    mode = config.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else mode
        if not isinstance(modes, list) or not all(isinstance(m, str) for m in modes):
            raise EmbeddingConfigError("the Pooling module's pooling_mode must be a name or a list of names")
        return modes
    return [name for key, name in LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]


def _read(checkpoint_dir: Path, name: str, kind: type):
    """The file's JSON value, checked to be a `kind`; an empty one when there is no such file."""
    try:
        value = read_json(checkpoint_dir / name)
    except (OSError, ValueError) as e:
        raise EmbeddingConfigError(f"cannot read {name}: {e}") from None
    if value == {}:  # no such file (or an empty object)
        return kind()
    if not isinstance(value, kind):
        raise EmbeddingConfigError(f"{name} must hold a JSON {'object' if kind is dict else 'array'}")
    return value
