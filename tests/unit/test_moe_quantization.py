"""Mixture-of-experts models in 8 bits: Qwen's FP8 MoE checkpoint format and bf16/float32 MoE checkpoints quantized
on load (fp8 blocks, int8 rows), in float32 against transformers' Qwen3MoeForCausalLM on the same weights dequantized
to float32; the 8-bit grouped expert kernels against a float64 loop over tokens and choices."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import ConfigError, Qwen3Config
from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_moe, triton_moe
from services.model_worker.model.layers.fused_moe import FusedMoE, reference_experts
from services.model_worker.model.layers.quant.eight_bit import EightBitLinearMethod
from services.model_worker.model.layers.quant.experts import (CpuEightBitExperts, DequantizingExperts,
                                                              EightBitExpertsMethod, dequantize_experts)
from tests.moe_checkpoints import make_moe_checkpoint
from tests.quant_checkpoints import FP8_CONFIG, write_dequantized, write_fp8
from tests.unit.test_engine_reference import forward, random_prompt
from tests.unit.test_moe_kernels import routing
from tests.unit.test_quantization import assert_matches as dense_assert_matches

# Partial 128-blocks everywhere: hidden 160 (128 + 32) is the experts' gate/up inputs and down outputs,
# moe_intermediate_size 160 their gate/up outputs and down inputs. Layer 1 is dense (mlp_only_layers).
SHAPE = dict(hidden_size=160, intermediate_size=288, moe_intermediate_size=160, num_attention_heads=4,
             num_key_value_heads=2, head_dim=40, num_hidden_layers=3, mlp_only_layers=[1], num_experts=8,
             num_experts_per_tok=2, tie_word_embeddings=False, initializer_range=0.2)


def engine(path, **flags) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=96, block_size=8, **flags))


def reference_model(path):
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_matches(ours: LLMEngine, reference) -> None:
    """A 37-token prefill (over the C kernel's 32 rows: the chosen experts dequantized for the call) and 16 greedy
    tokens (one-row decode steps on the C kernel's 8-bit entry), as the dense checks run them."""
    assert len(set(dense_assert_matches(ours, reference, new_tokens=16))) > 3


def experts_of(ours: LLMEngine) -> list[FusedMoE]:
    return [m for m in ours.model.modules() if isinstance(m, FusedMoE)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A random float32 MoE checkpoint, its FP8 copy (as Qwen publishes them: every expert and attention linear in
    fp8 blocks, the routers and the head left out) and that copy dequantized to float32."""
    root = tmp_path_factory.mktemp("moe_fp8")
    make_moe_checkpoint(root / "src", **SHAPE)
    routers = [f"model.layers.{i}.mlp.gate" for i in range(SHAPE["num_hidden_layers"]) if i != 1]
    write_fp8(root / "src", root / "fp8", root / "fp8_dequantized",
              {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", *routers]})
    return root


def test_fp8_moe_checkpoint_matches_transformers_on_its_dequantized_copy(source):
    ours = engine(source / "fp8")
    try:
        moes = experts_of(ours)
        assert len(moes) == 2
        for moe in moes:
            assert moe.w13.dtype == moe.w2.dtype == torch.float8_e4m3fn
            assert isinstance(moe.kernel, CpuEightBitExperts)
            # one row of scales per weight row: ceil(160 / 128) = 2 blocks of inputs each
            assert moe.w13_scale.shape == (8, 320, 2) and moe.w2_scale.shape == (8, 160, 2)
        layers = ours.model.model.layers
        assert layers[0].mlp.gate.weight.dtype == torch.float32  # the router as the checkpoint has it
        assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn  # the dense layer, fp8 too
        assert not isinstance(ours.model.lm_head.method, EightBitLinearMethod)
        assert_matches(ours, reference_model(source / "fp8_dequantized"))
    finally:
        ours.close()


def test_fp8_moe_checkpoint_in_bf16_is_as_close_to_float32_as_transformers_bf16(source):
    """bf16 compute with the experts widened from their bytes: no farther from transformers' float32 logits on the
    dequantized copy than twice transformers' own bf16 rounding."""
    reference = reference_model(source / "fp8_dequantized")
    prompt = random_prompt(21, seed=5)
    with torch.no_grad():
        exact = reference(torch.tensor([prompt])).logits[0]
        rounding = (reference.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float() - exact).abs().max().item()
    ours = LLMEngine(source / "fp8", EngineConfig(device="cpu", dtype="bfloat16", num_blocks=96, block_size=8))
    try:
        (logits,) = forward(ours, [prompt])
        assert (logits.float() - exact).abs().max().item() <= 2 * rounding
    finally:
        ours.close()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantize_on_load_matches_a_reference_that_rounds_the_same_way(source, fmt, tmp_path):
    write_dequantized(source / "src", tmp_path / "reference", fmt, lm_head=False)
    ours = engine(source / "src", quantization=fmt)
    try:
        for moe in experts_of(ours):
            assert moe.w13.element_size() == moe.w2.element_size() == 1
            blocks13, blocks2 = (1, 1) if fmt == "int8" else (2, 2)
            assert moe.w13_scale.shape == (8, 320, blocks13) and moe.w2_scale.shape == (8, 160, blocks2)
        assert_matches(ours, reference_model(tmp_path / "reference"))
    finally:
        ours.close()


def test_fp8_moe_configs_accept_routers_left_out_and_refuse_other_modules():
    raw = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, moe_intermediate_size=16, num_experts=8,
               num_experts_per_tok=2)
    left_out = ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    config = Qwen3Config.from_dict({**raw, "quantization_config": {**FP8_CONFIG, "modules_to_not_convert": left_out}})
    assert config.num_experts == 8 and config.quantization_config["quant_method"] == "fp8"
    for other in ("model.layers.0.mlp.experts.3.up_proj", "model.layers.1.self_attn.o_proj"):
        with pytest.raises(ConfigError, match="modules_to_not_convert") as e:
            Qwen3Config.from_dict({**raw, "quantization_config": {**FP8_CONFIG, "modules_to_not_convert": [other]}})
        assert other in str(e.value)


def test_a_quantized_router_is_named_not_guessed(source, tmp_path):
    """A checkpoint whose router is fp8 (not what Qwen publishes) is refused at load, naming the tensor."""
    from safetensors.torch import load_file, save_file
    from services.model_worker.model.loader import LoadError
    from tests.quant_checkpoints import fp8_blocks

    (tmp_path / "ck").mkdir()
    for f in (source / "fp8").iterdir():
        (tmp_path / "ck" / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "ck" / "model.safetensors")
    q, scales = fp8_blocks(tensors["model.layers.0.mlp.gate.weight"])
    tensors["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight_scale_inv"] = q, scales
    save_file(tensors, tmp_path / "ck" / "model.safetensors")
    with pytest.raises(LoadError, match=r"model\.layers\.0\.mlp\.gate\.weight_scale_inv"):
        engine(tmp_path / "ck")


# ---- the 8-bit grouped kernels against float64 ----

def c_kernel(x, moe, weights, ids):
    library = cpu_moe.load()
    assert library is not None, "the C kernel did not build"
    return cpu_moe.moe_experts_q8(library, x, moe.w13, moe.w13_scale, moe.block13, moe.w2, moe.w2_scale, moe.block2,
                                  weights, ids)


def triton_kernel(x, moe, weights, ids):
    return triton_moe.fused_moe(x, moe.w13, moe.w2, weights, ids, (moe.w13_scale, moe.block13, moe.w2_scale,
                                                                  moe.block2))


# The C kernel widens bytes with AVX-512 or AVX2 + F16C instructions where there are some, and with portable
# integer operations elsewhere: built for this CPU, for x86-64-v3 (AVX2, no AVX-512), and for plain x86-64.
KERNELS = {"c": c_kernel, "c_without_avx512": c_kernel, "c_portable": c_kernel, "triton": triton_kernel,
           "dequantize_chosen": DequantizingExperts()}
MARCH = {"c_without_avx512": "x86-64-v3", "c_portable": "x86-64"}


def random_experts(fmt: str, values: str, num_experts: int, hidden: int, intermediate: int, seed: int):
    """8-bit experts as a FusedMoE holds them, with random scales. values "all": every byte but e4m3's NaNs
    (subnormals, zeros and +-448 included); "subnormal": e4m3 bytes with a zero exponent field only."""
    generator = torch.Generator().manual_seed(seed)
    moe = SimpleNamespace(num_experts=num_experts)  # the attributes the kernels read of a loaded 8-bit FusedMoE

    def bytes_(*shape):
        raw = torch.randint(0, 256, shape, generator=generator, dtype=torch.int32)
        if fmt == "int8":
            return (raw - 128).clamp(-127, 127).to(torch.int8)
        raw = raw & 0x87 if values == "subnormal" else torch.where((raw & 0x7F) == 0x7F, raw - 1, raw)
        return raw.to(torch.uint8).view(torch.float8_e4m3fn)

    block13 = 128 if fmt == "fp8" else hidden
    block2 = 128 if fmt == "fp8" else intermediate
    moe.w13, moe.w2 = bytes_(num_experts, 2 * intermediate, hidden), bytes_(num_experts, hidden, intermediate)
    unit = 1.0 if values == "subnormal" else 1 / 300
    moe.w13_scale = torch.rand(num_experts, 2 * intermediate, -(-hidden // block13), generator=generator) * unit / 4
    moe.w2_scale = torch.rand(num_experts, hidden, -(-intermediate // block2), generator=generator) * unit / 4
    moe.block13, moe.block2 = block13, block2
    return moe


def dequantized(moe) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 experts: q * scale element by element (torch's own fp8 and int8 conversions)."""
    return (dequantize_experts(moe.w13, moe.w13_scale, moe.block13, torch.float32),
            dequantize_experts(moe.w2, moe.w2_scale, moe.block2, torch.float32))


def use_kernel(kernel: str, monkeypatch) -> None:
    if kernel == "triton" and not triton_moe.available():
        pytest.skip("triton is not installed")
    if kernel in MARCH:
        monkeypatch.setattr(build, "FLAGS", [f if f != "-march=native" else f"-march={MARCH[kernel]}"
                                             for f in build.FLAGS])


FORMATS = [("fp8", "all"), ("fp8", "subnormal"), ("int8", "all")]
KINDS = ["random", "every_token_to_one_expert", "most_experts_idle"]
# Every routing with every format for the C kernel as built here and for AVX2; one routing per format for the
# others (Triton's interpreter takes seconds a call; the portable build and the torch path share their code).
CASES = [(kernel, kind, fmt, values) for kernel in KERNELS for kind in KINDS for fmt, values in FORMATS
         if kernel in ("c", "c_without_avx512") or KINDS.index(kind) == FORMATS.index((fmt, values))]


@pytest.mark.parametrize("kernel,kind,fmt,values", CASES)
def test_eight_bit_grouped_kernel_matches_float64_loop(kernel, kind, fmt, values, monkeypatch):
    """float32 activations: every product is with float32(q * scale), so only the summation order differs."""
    use_kernel(kernel, monkeypatch)
    # 12 experts; H = 160 and I = 144: a partial fp8 block in both, rows not a multiple of the vector width.
    moe = random_experts(fmt, values, 12, 160, 144, seed=3)
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(4))
    weights, ids = routing(kind, 9, 12, 4, seed=2)
    want = reference_experts(x, *dequantized(moe), weights, ids)
    got = KERNELS[kernel](x, moe, weights, ids)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    if kind == "most_experts_idle":
        assert len(ids.unique()) < 6


@pytest.mark.parametrize("kernel,fmt", [(kernel, fmt) for kernel in KERNELS for fmt in ("fp8", "int8")
                                        if kernel != "triton" or fmt == "fp8"])
def test_eight_bit_grouped_kernel_in_bf16(kernel, fmt, monkeypatch):
    """bf16 activations: within a bf16 model's roundings of the float64 loop on the dequantized weights. Odd sizes
    (H 161, I 143): a weight row left alone at the end of the C kernel's pairs of rows, and scalar tails."""
    use_kernel(kernel, monkeypatch)
    moe = random_experts(fmt, "all", 12, 161, 143, seed=6)
    x = torch.randn(5, 161, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    weights, ids = routing("random", 5, 12, 4, seed=8)
    want = reference_experts(x, *dequantized(moe), weights, ids)
    got = KERNELS[kernel](x, moe, weights.to(torch.bfloat16), ids)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max().item() <= 3e-2 * want.abs().max().item()


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_experts_no_token_chose_are_never_read(kernel, monkeypatch):
    """NaN in every idle expert's scales: any use of an idle expert's weights would reach the output."""
    use_kernel(kernel, monkeypatch)
    moe = random_experts("fp8", "all", 16, 128, 64, seed=9)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(10))
    weights, ids = routing("random", 3, 16, 2, seed=5)
    want = reference_experts(x, *dequantized(moe), weights, ids)
    idle = torch.ones(16, dtype=torch.bool)
    idle[ids.unique()] = False
    moe.w13_scale[idle], moe.w2_scale[idle] = float("nan"), float("nan")
    got = KERNELS[kernel](x, moe, weights, ids)
    assert idle.sum() >= 10
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_fp8_experts_that_would_split_a_block_between_ranks_are_refused():
    """Each rank holds a slice of every expert's intermediate dimension: down_proj's fp8 blocks must not straddle."""
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(160 / 2 = 80\) must be a multiple of the 128"):
        FusedMoE(8, 2, 64, 160, True, TensorParallel(rank=0, size=2), EightBitExpertsMethod("fp8", True))
    moe = FusedMoE(8, 2, 64, 256, True, TensorParallel(rank=1, size=2), EightBitExpertsMethod("fp8", True))
    assert moe.w2.shape == (8, 64, 128) and moe.w2_scale.shape == (8, 64, 1)


# ---- tensor parallelism ----

# Each rank's 128 of moe_intermediate_size 256 is one whole fp8 block; hidden 192 ends in a partial block. One
# layer: the dense layers' split is test_quantization_tp's, and in float32 every fp8 linear dequantizes per call.
TP_SHAPE = dict(hidden_size=192, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, num_hidden_layers=1, num_experts=8, num_experts_per_tok=2,
                tie_word_embeddings=False, initializer_range=0.2)


@pytest.mark.parametrize("form", ["fp8-checkpoint", "int8"])
def test_two_ranks_compute_what_one_does(form, tmp_path):
    """fp8: each rank reads its rows of every expert's block scales; int8 on load: down_proj's row amax is taken
    over both ranks' halves of the row, so each quantizes as one rank would."""
    from tests.tp_probe import probe
    from tests.unit.test_quantization_tp import run_probe

    make_moe_checkpoint(tmp_path / "src", **TP_SHAPE)
    if form == "int8":
        path, quantization = tmp_path / "src", "int8"
    else:
        write_fp8(tmp_path / "src", tmp_path / "fp8", tmp_path / "fp8_dequantized",
                  {**FP8_CONFIG, "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"]})
        path, quantization = tmp_path / "fp8", "none"
    one = probe(str(path), 1, quantization)
    two = run_probe(path, 2, tmp_path / "tp2.json", quantization)
    assert (torch.tensor(two["logits"]) - torch.tensor(one["logits"])).abs().max().item() <= 1e-4
    for key in ("greedy", "batched", "chunked", "prefix_hit"):
        assert two[key] == one[key], key
