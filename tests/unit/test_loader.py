"""Checkpoint loading: config spellings, and a clear error for every way a checkpoint can be wrong."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model_worker.config.model import ConfigError, GenerationDefaults, Qwen3Config
from services.model_worker.model.loader import LoadError, load_model, resolve_dtype
from tests.checkpoints import make_checkpoint


@pytest.fixture()
def checkpoint(tmp_path):
    make_checkpoint(tmp_path, tie_word_embeddings=False)
    return tmp_path


def load(path):
    return load_model(path, Qwen3Config.from_json(path), torch.device("cpu"), torch.float32)


def edit_weights(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(checkpoint):
    edit_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(LoadError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load(checkpoint)


def test_wrong_shape_is_named(checkpoint):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1]
    edit_weights(checkpoint, shrink)
    with pytest.raises(LoadError, match=r"wrong shapes: model\.layers\.0\.self_attn\.k_proj\.weight: "
                                        r"checkpoint \[31, 64\], config expects \[32, 64\]"):
        load(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    edit_weights(checkpoint, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(LoadError, match=r"unexpected tensors .*model\.layers\.0\.mlp\.extra\.weight"):
        load(checkpoint)


def test_missing_lm_head_when_untied(checkpoint):
    edit_weights(checkpoint, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(LoadError, match=r"missing tensors: lm_head\.weight"):
        load(checkpoint)


def test_truncated_file(checkpoint):
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(LoadError, match=r"cannot read .*model\.safetensors.*truncated or corrupt"):
        load(checkpoint)


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(LoadError, match=r"pytorch_model\.bin are pickle files and are never loaded"):
        load_model(tmp_path, None, torch.device("cpu"), torch.float32)


def test_sharded_index_pointing_at_a_missing_file(tmp_path):
    make_checkpoint(tmp_path, max_shard_size="100KB", tie_word_embeddings=False)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(LoadError, match=f"lists {shard.name}"):
        load(tmp_path)


def test_other_architecture_is_refused(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["architectures"], raw["model_type"] = ["LlamaForCausalLM"], "llama"
    (checkpoint / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="unsupported architecture LlamaForCausalLM"):
        Qwen3Config.from_json(checkpoint)


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ConfigError, match="rope scaling type 'longrope' is not supported"):
        Qwen3Config.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                               "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_both_rope_theta_spellings_and_explicit_head_dim():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    top_level = Qwen3Config.from_dict({**base, "rope_theta": 123.0, "torch_dtype": "bfloat16"})
    nested = Qwen3Config.from_dict({**base, "rope_parameters": {"rope_theta": 123.0, "rope_type": "default"},
                                    "dtype": "float16"})
    assert top_level.rope_theta == nested.rope_theta == 123.0
    assert top_level.head_dim == 32 and top_level.torch_dtype == "bfloat16" and nested.torch_dtype == "float16"
    assert top_level.rope_scaling is None and nested.rope_scaling is None


def test_generation_config_eos_list_and_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [151645, 151643], "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    defaults = GenerationDefaults.from_dir(tmp_path)
    assert defaults.eos_token_ids == [151645, 151643]
    assert defaults.sampling == {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert GenerationDefaults.from_dir(tmp_path).eos_token_ids == [7]


def test_tied_embedding_is_shared(tmp_path):
    make_checkpoint(tmp_path, tie_word_embeddings=True)
    model = load(tmp_path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_auto_dtype():
    config = Qwen3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, torch_dtype="float16")
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.float16
    expected = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    assert resolve_dtype("auto", config, torch.device("cpu")) == expected
    with pytest.raises(LoadError, match="unknown dtype"):
        resolve_dtype("int3", config, torch.device("cpu"))
