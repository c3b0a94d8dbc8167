"""Resolve --model: a local checkpoint directory, or a hub id downloaded once into the usual cache."""
from __future__ import annotations

import logging
import pathlib

log = logging.getLogger(__name__)

CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]
# What the tokenizer service reads of a checkpoint: all of it but the weights, which may be gigabytes.
TOKENIZER_FILES = [pattern for pattern in CHECKPOINT_FILES if pattern != "*.safetensors"]


def resolve_model(model: str, patterns: list[str] = CHECKPOINT_FILES) -> pathlib.Path:
    """--model as a local directory: itself, or a hub id's snapshot of the files matching `patterns`."""
    path = pathlib.Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise SystemExit(f"--model {model}: not a checkpoint directory (expected a folder with config.json, "
                         "safetensors weights and tokenizer files, or a hub id such as Qwen/Qwen3-0.6B)")
    from huggingface_hub import snapshot_download  # only needed for hub ids

    log.info("fetching %s from the hub (cached after the first start)", model)
    try:
        return pathlib.Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, gated repo: all end the same way
        raise SystemExit(
            f"--model {model}: cannot download it from the hub ({type(e).__name__}: {e}). Offline? Download the "
            "checkpoint elsewhere and pass its local directory, e.g. --model /models/Qwen3-0.6B") from None


def served_model_name(model: str) -> str:
    """The model's id for clients: a local checkpoint's folder name, or the hub id as given.

    Not the path as given: clients (guidellm, evaluation harnesses) look the id up on a hub, where
    `./models/Qwen3-0.6B` means nothing.
    """
    path = pathlib.Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model
