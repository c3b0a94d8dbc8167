"""What the tokenizer service and the worker both read from a checkpoint's JSON files, read one way."""
from __future__ import annotations

import json
import pathlib
from typing import Any


def read_json(path: str | pathlib.Path) -> dict[str, Any]:
    """The file's object, or {} when there is no such file."""
    path = pathlib.Path(path)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def special_token_text(value) -> str | None:
    """A tokenizer_config.json special token: a string, an AddedToken-style dict, or null."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def eos_token_ids(checkpoint_dir: str | pathlib.Path) -> list[int]:
    """The ids that end generation, from the first file that names them.

    1. generation_config.json's eos_token_id (an id or a list), what transformers' generate uses;
    2. config.json's eos_token_id;
    3. tokenizer_config.json's eos_token (text), looked up as tokenizers would: added tokens first,
       then the vocabulary of tokenizer.json.
    The tokenizer service and the worker both call this, so they never disagree about the ids.
    """
    checkpoint_dir = pathlib.Path(checkpoint_dir)
    for name in ("generation_config.json", "config.json"):
        eos = read_json(checkpoint_dir / name).get("eos_token_id")
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    tokenizer_config = read_json(checkpoint_dir / "tokenizer_config.json")
    text = special_token_text(tokenizer_config.get("eos_token"))
    if not text:
        return []
    for token_id, token in (tokenizer_config.get("added_tokens_decoder") or {}).items():
        if special_token_text(token) == text:
            return [int(token_id)]
    tokenizer = read_json(checkpoint_dir / "tokenizer.json")
    for token in tokenizer.get("added_tokens") or []:
        if token.get("content") == text:
            return [token["id"]]
    token_id = ((tokenizer.get("model") or {}).get("vocab") or {}).get(text)
    return [] if token_id is None else [token_id]
