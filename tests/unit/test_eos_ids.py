"""The tokenizer service and the worker read the same eos ids from a checkpoint, in the same order of precedence."""
import json
import shutil

import pytest

from services.model_worker.config.model import GenerationDefaults
from services.tokenizer.core import TokenizerCore

ENDOFTEXT, IM_END = 151643, 151645  # Qwen3's added tokens


def both(path) -> tuple[list[int], list[int]]:
    return TokenizerCore.from_dir(path).info.eos_token_ids, GenerationDefaults.from_dir(path).eos_token_ids


@pytest.fixture()
def checkpoint(demo_tokenizer_dir, tmp_path):
    """tokenizer.json and a config.json, no generation_config.json and no tokenizer_config.json."""
    shutil.copy(demo_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    return tmp_path


def write(path, name: str, data: dict) -> None:
    (path / name).write_text(json.dumps(data))


def test_none_named_means_none(checkpoint):
    assert both(checkpoint) == ([], [])


def test_tokenizer_config_eos_text_when_nothing_else_names_ids(checkpoint):
    write(checkpoint, "tokenizer_config.json", {"eos_token": "<|endoftext|>"})
    assert both(checkpoint) == ([ENDOFTEXT], [ENDOFTEXT])
    write(checkpoint, "tokenizer_config.json", {"eos_token": {"content": "<|im_end|>", "special": True}})
    assert both(checkpoint) == ([IM_END], [IM_END])


def test_config_json_eos_wins_over_tokenizer_config(checkpoint):
    write(checkpoint, "tokenizer_config.json", {"eos_token": "<|endoftext|>"})
    write(checkpoint, "config.json", {"vocab_size": 151936, "eos_token_id": IM_END})
    assert both(checkpoint) == ([IM_END], [IM_END])


def test_generation_config_wins_over_both_and_keeps_its_order(checkpoint):
    write(checkpoint, "tokenizer_config.json", {"eos_token": "<|endoftext|>"})
    write(checkpoint, "config.json", {"vocab_size": 151936, "eos_token_id": ENDOFTEXT})
    write(checkpoint, "generation_config.json", {"eos_token_id": [IM_END, ENDOFTEXT]})
    assert both(checkpoint) == ([IM_END, ENDOFTEXT], [IM_END, ENDOFTEXT])
