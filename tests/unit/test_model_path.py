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
