"""Preflight for --model: exits 0 if it names a usable checkpoint (or a hub id), else 1 with what is missing and what to do."""
from __future__ import annotations

import argparse
import pathlib
import sys

# What the tokenizer service and the worker read; weights are either a single file or a sharded index.
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def is_hub_id(model: str) -> bool:
    """The same rule as checkpoint.path: `owner/name`, not a path."""
    return not model.startswith((".", "/", "~")) and model.count("/") == 1 and not pathlib.Path(model).exists()


def problems(model: str) -> list[str]:
    """What keeps `model` from loading; empty when nothing does (a hub id is checked when it downloads)."""
    if is_hub_id(model):
        return []
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        return [f"{model} does not exist"]
    if not path.is_dir():
        return [f"{model} is not a directory"]
    missing = [name for name in REQUIRED_FILES if not (path / name).is_file()]
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        missing.append(" or ".join(WEIGHT_FILES))
    return [f"{model} has no {name}" for name in missing]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m checkpoint.check", description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint directory or hub id, as the services take it")
    parser.add_argument("--hint", default="pass --model a checkpoint directory (config.json, safetensors weights, "
                        "tokenizer files) or a hub id such as Qwen/Qwen3-0.6B",
                        help="what to tell the user to do when the checkpoint is not usable")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found = problems(args.model)
    if not found:
        what = "a hub id, downloaded when the services start" if is_hub_id(args.model) else "a checkpoint"
        print(f"--model {args.model}: {what}")
        return 0
    print(f"no usable checkpoint: {'; '.join(found)}.\n{args.hint}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
