"""The demo checkpoint loads in transformers' Qwen3ForCausalLM with every tensor where HF expects it."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3ForCausalLM

from demo.checkpoint import build_demo_checkpoint, main, qwen3_config
from demo.weights import write_random_weights

# Published Qwen/Qwen3-0.6B config.json, less its transformers_version.
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_tied")
    main(["--out", str(out), "--preset", "tiny", "--seed", "3"])
    return out


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_untied")
    return build_demo_checkpoint(out, preset="tiny", dtype="float32", seed=3, tie_word_embeddings=False)


def file_tensors(checkpoint_dir):
    with safe_open(str(checkpoint_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        return {name: f.get_tensor(name) for name in f.keys()}


def load_reference(checkpoint_dir):
    model, info = Qwen3ForCausalLM.from_pretrained(str(checkpoint_dir), output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    return model


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_transformers_loads_every_tensor(request, which):
    checkpoint_dir = request.getfixturevalue(f"{which}_dir")
    model = load_reference(checkpoint_dir)
    tensors = file_tensors(checkpoint_dir)
    state = model.state_dict()
    expected_names = set(state) - ({"lm_head.weight"} if which == "tied" else set())
    assert set(tensors) == expected_names
    for name, tensor in tensors.items():
        assert tensor.shape == state[name].shape, name
        assert torch.equal(tensor, state[name]), name
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied is (which == "tied")


def test_files_and_dtypes(tied_dir, untied_dir):
    for checkpoint_dir, dtype in ((tied_dir, torch.bfloat16), (untied_dir, torch.float32)):
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert (checkpoint_dir / name).is_file()
        assert "RANDOM" in (checkpoint_dir / "README.md").read_text()
        assert {tensor.dtype for tensor in file_tensors(checkpoint_dir).values()} == {dtype}
    config = json.loads((tied_dir / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is True
    generation = json.loads((tied_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643] and generation["top_k"] == 20


def test_weights_follow_hf_initialization(untied_dir):
    tensors = file_tensors(untied_dir)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            assert torch.all(tensor == 1), name
        else:
            assert abs(tensor.float().std().item() - 0.02) < 0.002, name
            assert abs(tensor.float().mean().item()) < 0.002, name


def test_same_seed_same_bytes(tmp_path):
    config = qwen3_config("tiny", "bfloat16")
    first = write_random_weights(tmp_path / "a.safetensors", config, "bfloat16", seed=7).read_bytes()
    second = write_random_weights(tmp_path / "b.safetensors", config, "bfloat16", seed=7).read_bytes()
    other = write_random_weights(tmp_path / "c.safetensors", config, "bfloat16", seed=8).read_bytes()
    assert first == second
    assert first != other


def test_qwen3_0_6b_preset_is_the_published_config():
    assert qwen3_config("qwen3-0.6b", "bfloat16") == QWEN3_0_6B_CONFIG


def test_unknown_preset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        build_demo_checkpoint(tmp_path, preset="qwen3-235b")


def test_module_help():
    result = subprocess.run(
        [sys.executable, "-m", "demo.checkpoint", "--help"], capture_output=True, text=True, check=True
    )
    assert "--preset" in result.stdout and "RANDOM" in result.stdout
