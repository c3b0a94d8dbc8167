"""Mixture of experts on a CUDA GPU: the Triton kernel (bf16 and 8-bit experts), and the engine (decode in CUDA
graphs) against transformers."""
import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.model.layers.fused_moe import TritonExperts, reference_experts
from tests.moe_checkpoints import make_moe_checkpoint
from tests.unit.test_engine_cuda import random_prompt, reference_generate
from tests.unit.test_moe_kernels import routing

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_triton_experts_match_float64_loop_on_the_gpu(dtype):
    torch.manual_seed(0)
    x = torch.randn(37, 256)
    w13 = torch.randn(16, 2 * 128, 256) / 16
    w2 = torch.randn(16, 256, 128) / 11
    weights, ids = routing("random", 37, 16, 4, seed=1)
    want = reference_experts(x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    got = TritonExperts()(x.to(dtype).cuda(), w13.to(dtype).cuda(), w2.to(dtype).cuda(),
                          weights.to(dtype).cuda(), ids.cuda()).cpu()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.double() - want).abs().max().item() <= tolerance * want.abs().max().item()


def test_float32_greedy_equals_transformers_with_decode_graphs(tmp_path):
    reference = make_moe_checkpoint(tmp_path, num_hidden_layers=3, mlp_only_layers=[1], num_experts=16,
                                    num_experts_per_tok=4).to("cuda")
    engine = LLMEngine(tmp_path, EngineConfig(device="cuda", dtype="float32", num_blocks=128, block_size=8))
    assert engine.model.model.layers[0].mlp.experts.kernel.name == "triton"
    assert engine.runner.graphs is not None  # decode steps replay CUDA graphs
    prompts = [random_prompt(n, seed=40 + n) for n in (11, 3, 29)]
    expected = [reference_generate(reference, p, 32) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    assert [engine.generate([p], params)[0] for p in prompts] == expected
    assert engine.generate(prompts, params) == expected
    assert all(len(set(e)) > 3 for e in expected)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_eight_bit_triton_experts_match_float64_loop_on_the_gpu(fmt):
    """The Triton kernels on 8-bit experts (bytes widened in registers) against the float64 loop on their
    dequantized weights, in bf16."""
    from tests.unit.test_moe_quantization import dequantized, random_experts, triton_kernel

    moe = random_experts(fmt, "all", 16, 256, 128, seed=11)
    x = torch.randn(37, 256, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    weights, ids = routing("random", 37, 16, 4, seed=13)
    want = reference_experts(x, *dequantized(moe), weights, ids)
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        setattr(moe, name, getattr(moe, name).cuda())
    got = triton_kernel(x.cuda(), moe, weights.to(torch.bfloat16).cuda(), ids.cuda()).cpu()
    assert (got.double() - want).abs().max().item() <= 3e-2 * want.abs().max().item()
