"""Weights packed for oneDNN give the plain model's logits and greedy tokens, in float32 and bfloat16."""
import pytest
import torch
from torch import nn

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.model.layers.linear import (LinearBase, LinearMethod, PackedLinearMethod, PlainLinearMethod,
                                                       ReplicatedLinear, packing_supported, use_linear_method)
from tests.checkpoints import make_checkpoint
from tests.unit.test_engine_reference import forward, random_prompt

CPU = torch.device("cpu")
DTYPES = [pytest.param(d, marks=pytest.mark.skipif(not packing_supported(CPU, d), reason="no oneDNN support"))
          for d in (torch.float32, torch.bfloat16)]
# bf16 packed matmuls are bit-identical on the machines measured; allow for a different kernel elsewhere.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def as_layer(linear: nn.Linear, method: LinearMethod) -> ReplicatedLinear:
    """Our linear layer holding nn.Linear's very weight and bias, processed by `method`."""
    layer = ReplicatedLinear(linear.in_features, linear.out_features, linear.bias is not None).to(linear.weight.dtype)
    layer.weight, layer.bias = linear.weight, linear.bias
    use_linear_method(layer, method)
    return layer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("packed")
    make_checkpoint(path, tie_word_embeddings=False)
    return path


def engines(checkpoint, dtype: torch.dtype) -> tuple[LLMEngine, LLMEngine]:
    name = str(dtype).removeprefix("torch.")
    make = lambda pack: LLMEngine(checkpoint, EngineConfig(device="cpu", dtype=name, num_blocks=96,  # noqa: E731
                                                           block_size=8, pack_weights=pack, small_batch_kernel=False))
    return make(False), make(True)


def test_every_linear_is_swapped(checkpoint):
    plain, packed = engines(checkpoint, torch.float32)
    linears = [n for n, m in plain.model.named_modules() if isinstance(m, LinearBase)]
    assert len(linears) == 2 * plain.config.num_hidden_layers * 2 + 1
    assert all(isinstance(m.method, PlainLinearMethod) for m in plain.model.modules() if isinstance(m, LinearBase))
    assert not any(isinstance(getattr(m, "method", None), PlainLinearMethod) for m in packed.model.modules())
    assert sorted(n for n, m in packed.model.named_modules()
                  if isinstance(getattr(m, "method", None), PackedLinearMethod)) == sorted(linears)


def test_packing_is_on_by_default_on_cpu(checkpoint):
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=16, block_size=8))
    assert isinstance(engine.model.lm_head.method, PackedLinearMethod)


@pytest.mark.parametrize("rows", [1, 3, 16, 200])
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_matches_linear_for_any_row_count(dtype, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 80, bias=True).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = linear(x)
    out = as_layer(linear, PackedLinearMethod())(x)
    assert out.dtype == dtype and out.shape == expected.shape
    assert (out.float() - expected.float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_model_gives_the_same_logits(checkpoint, dtype):
    plain, packed = engines(checkpoint, dtype)
    prompts = [random_prompt(n, seed=40 + n) for n in (1, 7, 33)]
    for a, b in zip(forward(plain, prompts), forward(packed, prompts)):   # a batched prefill
        assert (a.float() - b.float()).abs().max().item() <= TOLERANCE[dtype]
    longer = [p + random_prompt(2, seed=50 + i) for i, p in enumerate(prompts)]
    decode = [len(p) - 1 for p in longer]
    forward(plain, [p[:-1] for p in longer], [len(p) for p in prompts])
    forward(packed, [p[:-1] for p in longer], [len(p) for p in prompts])
    for a, b in zip(forward(plain, longer, decode), forward(packed, longer, decode)):  # batched decode
        assert (a.float() - b.float()).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_model_generates_the_same_tokens(checkpoint, dtype):
    plain, packed = engines(checkpoint, dtype)
    prompts = [random_prompt(n, seed=60 + n) for n in (5, 19)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = plain.generate(prompts, params)
    assert packed.generate(prompts, params) == expected
    assert len(set(expected[0])) > 3


def test_pack_linears_can_leave_the_head_alone(checkpoint):
    plain, _ = engines(checkpoint, torch.float32)
    swapped = use_linear_method(plain.model, PackedLinearMethod(), include_lm_head=False)
    assert swapped == 2 * plain.config.num_hidden_layers * 2
    assert isinstance(plain.model.lm_head.method, PlainLinearMethod)
