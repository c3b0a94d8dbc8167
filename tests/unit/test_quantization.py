"""8-bit weights in float32 compute against transformers on the same weights dequantized to float32: Qwen's FP8
checkpoint format, and bf16/float32 checkpoints quantized on load (fp8 blocks, int8 rows); the loader's refusals."""
from __future__ import annotations

import json

import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import ConfigError, Qwen3Config
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.model.layers.linear import linear_layers
from services.model_worker.model.layers.quant.eight_bit import EightBitLinearMethod
from tests.checkpoints import make_checkpoint
from tests.quant_checkpoints import FP8_CONFIG, write_dequantized, write_fp8
from tests.unit.test_engine_reference import forward, random_prompt

# Partial 128-blocks in both dimensions (160 = 128 + 32 inputs, 288 = 2 x 128 + 32 outputs), GQA (4 q heads
# over 2 kv heads); tied and untied heads; several files.
SHAPES = {
    "partial_blocks_gqa_tied": dict(hidden_size=160, intermediate_size=288, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=40),
    "untied_sharded": dict(hidden_size=160, intermediate_size=288, num_attention_heads=4, num_key_value_heads=1,
                           head_dim=48, tie_word_embeddings=False, max_shard_size="200KB"),
}


def engine(path, **flags) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=96, block_size=8, **flags))


def reference_model(path):
    from transformers import Qwen3ForCausalLM
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_matches(ours: LLMEngine, reference, new_tokens: int = 24) -> list[int]:
    """A 37-token prompt's logits within 1e-4 of the reference's, and the same greedy tokens after another
    prompt; returns those tokens."""
    prompt = random_prompt(37, seed=1)
    (logits,) = forward(ours, [prompt])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt])).logits[0]
    assert (logits - expected).abs().max().item() <= 1e-4
    prompt = random_prompt(11, seed=2)
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    assert ours.generate([prompt], params)[0] == greedy
    return greedy


@pytest.fixture(scope="module", params=list(SHAPES))
def source(request, tmp_path_factory):
    """A random float32 checkpoint, its FP8 copy and that copy dequantized."""
    root = tmp_path_factory.mktemp(request.param)
    overrides = dict(SHAPES[request.param])
    make_checkpoint(root / "src", **overrides)
    write_fp8(root / "src", root / "fp8", root / "fp8_dequantized")
    return root


def test_fp8_checkpoint_matches_transformers_on_its_dequantized_copy(source):
    ours = engine(source / "fp8")
    try:
        layer = ours.model.model.layers[0].self_attn.qkv_proj
        assert layer.weight.dtype == torch.float8_e4m3fn and isinstance(layer.method, EightBitLinearMethod)
        assert not isinstance(ours.model.lm_head.method, EightBitLinearMethod)  # the head stays as the checkpoint has it
        assert_matches(ours, reference_model(source / "fp8_dequantized"))
    finally:
        ours.close()


def test_fp8_checkpoint_in_bf16_is_as_close_to_float32_as_transformers_bf16(source):
    """bf16 compute on the C kernels (the weights widened from their bytes): its logits no farther from
    transformers' float32 ones on the dequantized copy than twice transformers' own bf16 rounding."""
    reference = reference_model(source / "fp8_dequantized")
    prompt = random_prompt(29, seed=5)
    with torch.no_grad():
        exact = reference(torch.tensor([prompt])).logits[0]
        rounding = (reference.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float() - exact).abs().max().item()
    ours = LLMEngine(source / "fp8", EngineConfig(device="cpu", dtype="bfloat16", num_blocks=96, block_size=8))
    try:
        assert ours.model.model.layers[0].mlp.gate_up_proj.q8 is not None  # the kernels, not a dequantized copy
        (logits,) = forward(ours, [prompt])
        assert (logits.float() - exact).abs().max().item() <= 2 * rounding
    finally:
        ours.close()


@pytest.mark.parametrize("shape,fmt", [("partial_blocks_gqa_tied", "int8"), ("untied_sharded", "fp8")])
def test_quantize_on_load_matches_a_reference_that_rounds_the_same_way(shape, fmt, tmp_path):
    make_checkpoint(tmp_path / "src", **SHAPES[shape])
    write_dequantized(tmp_path / "src", tmp_path / "reference", fmt, lm_head=True)
    ours = engine(tmp_path / "src", quantization=fmt, quantize_lm_head=True)
    try:
        head = ours.model.lm_head
        assert head.weight.element_size() == 1 and head.weight_scale_inv.dtype == torch.float32
        assert ours.model.model.embed_tokens.weight.dtype == torch.float32  # a tied embedding keeps its table
        layers = [m for _, m in linear_layers(ours.model)]
        weights = sum(m.in_features * m.out_features for m in layers)
        held = sum(t.numel() * t.element_size() for m in layers for t in m.parameters())
        # One byte a weight plus the float32 scales (a row's, or a row's per 128 inputs), not four bytes a weight.
        scales = sum(m.out_features * (1 if fmt == "int8" else -(-m.in_features // 128)) for m in layers)
        assert held == weights + 4 * scales
        assert_matches(ours, reference_model(tmp_path / "reference"))
    finally:
        ours.close()


def fp8_config(**changes) -> dict:
    raw = json.loads(json.dumps(dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, architectures=["Qwen3ForCausalLM"])))
    raw["quantization_config"] = {**FP8_CONFIG, **changes}
    return raw


@pytest.mark.parametrize("changes,named", [
    (dict(quant_method="gptq"), "'gptq'"), (dict(quant_method="awq"), "'awq'"),
    (dict(weight_block_size=[64, 64]), "[64, 64]"), (dict(weight_block_size=None), "None"),
    (dict(fmt="e5m2"), "'e5m2'"), (dict(activation_scheme="static"), "'static'"),
    (dict(modules_to_not_convert=["model.layers.0.mlp.down_proj"]), "down_proj"),
])
def test_other_quantizations_are_refused_naming_what(changes, named):
    with pytest.raises(ConfigError, match="quantization_config|fp8") as e:
        Qwen3Config.from_dict(fp8_config(**changes))
    assert named in str(e.value)


def test_qwen_fp8_config_with_the_head_left_out_is_accepted():
    config = Qwen3Config.from_dict(fp8_config(modules_to_not_convert=["lm_head"]))
    assert config.quantization_config["quant_method"] == "fp8"


def test_int8_is_refused_for_an_fp8_checkpoint(source):
    with pytest.raises(ValueError, match="already fp8"):
        engine(source / "fp8", quantization="int8")


def test_a_head_flag_without_quantization_is_refused(source):
    with pytest.raises(ValueError, match="quantize-lm-head"):
        engine(source / "src", quantize_lm_head=True)
