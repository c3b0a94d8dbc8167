"""A worker or tokenizer that refuses its checkpoint at start says why in one line and exits, with no traceback after it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import make_checkpoint
from tests.integration.stack import ROOT


def unsupported_architecture(path):
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))


def unexpected_tensor(path):
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.router.weight"] = torch.zeros(4, 4)
    save_file(tensors, weights)


@pytest.mark.parametrize("spoil, reason", [
    (unsupported_architecture, "unsupported architecture LlamaForCausalLM"),
    (unexpected_tensor, "unexpected tensors (not part of Qwen3ForCausalLM): model.layers.0.mlp.router.weight"),
], ids=["architecture", "tensors"])
def test_a_refused_checkpoint_ends_the_worker_with_its_reason_alone(tmp_path, spoil, reason):
    make_checkpoint(tmp_path)
    spoil(tmp_path)
    result = subprocess.run([sys.executable, "-m", "services.model_worker", "--model", str(tmp_path), "--port", "0",
                             "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot serve {tmp_path}: ") and reason in last, result.stderr
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr, result.stderr
    assert "never awaited" not in result.stderr, result.stderr


@pytest.mark.parametrize("spoil, reason", [
    (lambda path: (path / "tokenizer.json").unlink(missing_ok=True), "has no tokenizer.json"),
    (lambda path: (path / "tokenizer.json").write_text("{not json"), "cannot read"),
], ids=["missing", "unreadable"])
def test_a_tokenizer_without_a_usable_tokenizer_json_says_why_in_one_line(tmp_path, spoil, reason):
    make_checkpoint(tmp_path)
    spoil(tmp_path)
    result = subprocess.run([sys.executable, "-m", "services.tokenizer", "--model", str(tmp_path), "--port", "0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cannot serve {tmp_path}: ") and reason in last, result.stderr
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr, result.stderr
