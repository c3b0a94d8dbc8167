"""The hand-built Qwen3MoeForCausalLM against transformers' on the same random checkpoints, in float32."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import ConfigError, Qwen3Config
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.model.layers.fused_moe import FusedMoE
from services.model_worker.model.loader import LoadError, load_model
from tests.moe_checkpoints import make_moe_checkpoint
from tests.unit.test_engine_reference import forward, random_prompt, reference_logits
# The dense model's reference tests, run here on this module's `pair` (each MoE shape and transformers):
# logits within 1e-4, 32 greedy tokens equal to generate, batched rows and sequences equal to each alone.
from tests.unit.test_engine_reference import (  # noqa: F401 - collected by pytest in this module
    test_batched_sequences_match_each_alone, test_greedy_continuation_matches_generate, test_logits_match_reference,
    test_several_sequences_generate_like_alone)

SHAPES = {
    "e8_top2_norm_tied": {},
    "e16_top4_unnormalised_untied_sharded": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                                                 tie_word_embeddings=False, max_shard_size="100KB"),
    # Layers 0 and 2 dense (decoder_sparse_step 2, mlp_only_layers [2]), 1 and 3 with experts.
    "dense_layers_mixed_in": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[2], num_experts=12,
                                  num_experts_per_tok=4),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = make_moe_checkpoint(path, **SHAPES[request.param])
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=96, block_size=8))
    return reference, engine


def test_layers_are_sparse_where_the_config_says(pair):
    reference, engine = pair
    ours = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in engine.model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in reference.model.layers]
    assert ours == theirs


def test_fused_3d_expert_tensors_load_like_per_expert_ones(tmp_path):
    """transformers holds experts as (E, 2I, H) and (E, H, I) tensors in memory; a file in that layout loads too."""
    make_moe_checkpoint(tmp_path)
    config = Qwen3Config.from_json(tmp_path)
    per_expert = load_model(tmp_path, config, torch.device("cpu"), torch.float32)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        parts = {p: [tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(config.num_experts)]
                 for p in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(gu) for gu in zip(parts["gate_proj"],
                                                                                       parts["up_proj"])])
        tensors[f"{prefix}.down_proj"] = torch.stack(parts["down_proj"])
    save_file(tensors, tmp_path / "model.safetensors")
    fused = load_model(tmp_path, config, torch.device("cpu"), torch.float32)
    for a, b in zip(per_expert.model.layers, fused.model.layers):
        assert torch.equal(a.mlp.experts.w13, b.mlp.experts.w13) and torch.equal(a.mlp.experts.w2, b.mlp.experts.w2)


def test_a_missing_expert_is_named(tmp_path):
    make_moe_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(LoadError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(tmp_path, Qwen3Config.from_json(tmp_path), torch.device("cpu"), torch.float32)


def test_config_reads_both_spellings_and_refuses_bad_expert_counts():
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, moe_intermediate_size=16, num_experts_per_tok=2)
    assert Qwen3Config.from_dict({**base, "num_experts": 8}).num_experts == 8
    assert Qwen3Config.from_dict({**base, "num_local_experts": 8}).num_experts == 8  # transformers 5
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        Qwen3Config.from_dict({**base, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="num_experts must be a positive integer"):
        Qwen3Config.from_dict(base)


@pytest.mark.parametrize("kernel", ["triton", "torch_grouped"])
def test_every_experts_kernel_gives_the_reference_logits_in_the_model(tmp_path, kernel):
    """The GPU's Triton kernel (here in its interpreter) and torch's grouped matmul, in place of the C kernel."""
    from services.model_worker.kernels import triton_moe
    from services.model_worker.model.layers.fused_moe import TorchGroupedExperts, TritonExperts

    if kernel == "triton" and not triton_moe.available():
        pytest.skip("triton is not installed")
    reference = make_moe_checkpoint(tmp_path, num_experts=12, num_experts_per_tok=4, tie_word_embeddings=False)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", num_blocks=16, block_size=8))
    for module in engine.model.modules():
        if isinstance(module, FusedMoE):
            module.kernel = TritonExperts() if kernel == "triton" else TorchGroupedExperts()
    prompt = random_prompt(13, seed=5)
    (ours,) = forward(engine, [prompt])
    assert (ours - reference_logits(reference, prompt)).abs().max().item() <= 1e-4


PUBLISHED = {  # config.json of the published checkpoints (the keys the model reads), and their sizes
    "Qwen3-30B-A3B": (dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                           num_attention_heads=32, num_key_value_heads=4), 30.5e9, 3.3e9),
    "Qwen3-235B-A22B": (dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                             num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4), 235e9, 22e9),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_shapes_build_with_their_parameter_counts(name):
    """Built without memory: every expert of every layer is there, and a token's share is the advertised one."""
    from services.model_worker.distributed.parallel import check_divisible
    from services.model_worker.model.qwen3_moe import Qwen3MoeForCausalLM

    shape, total, active = PUBLISHED[name]
    config = Qwen3Config.from_dict({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": False, **shape})
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())
    experts = sum(m.w13.numel() + m.w2.numel() for m in model.modules() if isinstance(m, FusedMoE))
    per_token = count - experts * (1 - config.num_experts_per_tok / config.num_experts)
    assert abs(count / total - 1) < 0.02 and abs(per_token / active - 1) < 0.05
    check_divisible(config, 4)  # 4 KV heads: up to 4 ranks
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        check_divisible(config, 8)
