"""--model resolution: local directories, and a hub id that cannot be fetched says how to pass a directory."""
import os
import subprocess
import sys

import pytest

from checkpoint.path import resolve_model, served_model_name
from tests.integration.stack import ROOT


def test_local_directory_is_used_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="not a checkpoint directory"):
        resolve_model(str(tmp_path / "nope"))


def test_hub_id_offline_says_to_pass_a_local_directory(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", "from checkpoint.path import resolve_model; "
                             "resolve_model('Qwen/Qwen3-0.6B')"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "cannot download it from the hub" in result.stderr
    assert "pass its local directory" in result.stderr


def test_served_name_is_the_checkpoint_folder_name_or_the_hub_id(tmp_path, monkeypatch):
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    assert served_model_name(str(folder)) == "Qwen3-0.6B"
    assert served_model_name(str(folder) + "/") == "Qwen3-0.6B"
    monkeypatch.chdir(folder)
    assert served_model_name(".") == "Qwen3-0.6B"
    monkeypatch.chdir(tmp_path)
    assert served_model_name("Qwen3-0.6B") == "Qwen3-0.6B"
    # Not a local folder: the hub id, which is also what clients look the model up by.
    assert served_model_name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


# The files of the published Qwen/Qwen3-0.6B repository.
QWEN3_HUB_FILES = [".gitattributes", "LICENSE", "README.md", "config.json", "generation_config.json", "merges.txt",
                   "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json"]


def test_a_hub_id_fetches_for_the_tokenizer_everything_it_reads_but_the_weights(tmp_path, monkeypatch):
    import fnmatch

    import huggingface_hub

    from checkpoint.path import CHECKPOINT_FILES, TOKENIZER_FILES

    asked = []

    def snapshot_download(repo_id, allow_patterns):  # the hub, which tests cannot reach
        asked.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_model("Qwen/Qwen3-0.6B", TOKENIZER_FILES) == tmp_path
    assert resolve_model("Qwen/Qwen3-0.6B") == tmp_path
    assert asked == [("Qwen/Qwen3-0.6B", TOKENIZER_FILES), ("Qwen/Qwen3-0.6B", CHECKPOINT_FILES)]

    def fetched(patterns):
        return {name for name in QWEN3_HUB_FILES if any(fnmatch.fnmatch(name, p) for p in patterns)}

    assert fetched(CHECKPOINT_FILES) - fetched(TOKENIZER_FILES) == {"model.safetensors"}
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"} <= fetched(
        TOKENIZER_FILES)
