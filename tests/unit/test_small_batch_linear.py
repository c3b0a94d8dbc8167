"""The small-batch bf16 matmul kernel against float64, and the engine that uses it against the plain model."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_linear
from services.model_worker.model.layers.linear import (PackedLinearMethod, ReplicatedLinear, SmallBatchLinearMethod,
                                                       use_linear_method)
from tests.checkpoints import make_checkpoint
from tests.unit.test_engine_reference import forward, random_prompt
from tests.unit.test_optimize import as_layer

HAS_BF16_DOT = "avx512_bf16" in build.cpu_features()
needs_kernel = pytest.mark.skipif(not HAS_BF16_DOT, reason="the CPU has no AVX512-BF16")


@pytest.fixture(scope="module")
def library():
    library = cpu_linear.load()
    assert library is not None, "the kernel must build on a CPU with AVX512-BF16 (gcc is on the test machine)"
    return library


def rounding_bound(reference: torch.Tensor) -> float:
    """One bf16 rounding of the largest output, plus float32 summation: what F.linear itself may be off by."""
    return reference.abs().max().item() * 2 ** -8 + 1e-3


def test_any_leading_shape_or_stride_gives_the_rows_of_the_flat_call(library):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=gen).bfloat16()
    w = torch.randn(40, 64, generator=gen).bfloat16()
    flat = cpu_linear.small_batch_linear(library, x, w)
    assert torch.equal(cpu_linear.small_batch_linear(library, x.view(2, 3, 64), w), flat.view(2, 3, 40))
    strided = torch.cat((x, x), dim=-1)[:, :64]  # rows 128 apart
    assert not strided.is_contiguous()
    assert torch.equal(cpu_linear.small_batch_linear(library, strided, w), flat)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 12, 13, 25])
@pytest.mark.parametrize("out_features,in_features", [(7, 32), (333, 1024), (1000, 96)])
def test_kernel_matches_float64(library, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    reference = x.double() @ w.double().T
    out = cpu_linear.small_batch_linear(library, x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert (out.double() - reference).abs().max().item() <= rounding_bound(reference)
    # Each output is the float32 sum rounded once: within half a bf16 step of the exact value, as F.linear's.
    assert (out.double() - reference).abs().max().item() <= (F.linear(x, w).double() - reference).abs().max() * 2
    # Every row count sums each output's products in one order: a row gets the bits it gets alone.
    assert torch.equal(out, torch.cat([cpu_linear.small_batch_linear(library, x[i:i + 1], w) for i in range(rows)]))


@needs_kernel
def test_module_routes_few_rows_to_the_kernel_and_many_to_oneDNN(library):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).bfloat16()
    module = as_layer(linear, SmallBatchLinearMethod(library))
    assert module.small_rows >= SmallBatchLinearMethod.MAX_ROWS
    many = torch.randn(1, module.small_rows + 1, 64).bfloat16()  # over the kernel's rows: F.linear bit for bit
    assert torch.equal(module(many), F.linear(many, linear.weight, linear.bias))
    few = torch.randn(3, 64).bfloat16()
    reference = few.double() @ linear.weight.double().T + linear.bias.double()
    assert (module(few).double() - reference).abs().max().item() <= rounding_bound(reference) * 2
    assert module.weight is linear.weight  # no copy of the weights


@needs_kernel
@pytest.mark.parametrize("in_features", [64, 1024, 2048, 3072])
def test_the_kernel_takes_as_many_rows_as_it_is_faster_for_and_each_row_gets_its_bits_alone(library, in_features):
    rows = cpu_linear.small_batch_max_rows(library, in_features)
    if "amx_tile" in build.cpu_features():
        assert rows == 4  # measured there: oneDNN is faster from 8 rows
    else:  # one tile of rows whose inputs fit 24 KB of L1 (at most 12), at least 4
        assert rows == max(4, min(12, 24 * 1024 // (2 * in_features)))
    gen = torch.Generator().manual_seed(in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(80, in_features, generator=gen).bfloat16()
    together = cpu_linear.small_batch_linear(library, x, w)
    alone = torch.cat([cpu_linear.small_batch_linear(library, x[i:i + 1], w) for i in range(rows)])
    assert torch.equal(together, alone)
    reference = x.double() @ w.double().T
    assert (together.double() - reference).abs().max().item() <= rounding_bound(reference)


@needs_kernel
def test_only_weights_the_kernel_takes_are_swapped(library):
    model = nn.Sequential(ReplicatedLinear(64, 8), ReplicatedLinear(8, 64), ReplicatedLinear(64, 64)).bfloat16()
    model[2].float()
    assert use_linear_method(model, SmallBatchLinearMethod(library)) == 3
    # 8 inputs: not a multiple of 32; float32: not bf16. Those two run F.linear.
    assert [m.kernel is not None for m in model] == [True, False, False]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("small-batch")
    make_checkpoint(path, tie_word_embeddings=False)
    return path


def make_engine(checkpoint, kernel: bool) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=96, block_size=8,
                                              pack_weights=False, small_batch_kernel=kernel))


@needs_kernel
def test_engine_uses_the_kernel_by_default_for_bf16_and_packs_otherwise(checkpoint):
    default = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16, block_size=8))
    assert isinstance(default.model.lm_head.method, SmallBatchLinearMethod)
    off = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16, block_size=8,
                                          small_batch_kernel=False))
    assert isinstance(off.model.lm_head.method, PackedLinearMethod)
    fp32 = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=16, block_size=8))
    assert not any(isinstance(getattr(m, "method", None), SmallBatchLinearMethod) for m in fp32.model.modules())


@needs_kernel
def test_decode_logits_match_the_plain_model_within_bf16_rounding(checkpoint):
    plain, kernel = make_engine(checkpoint, False), make_engine(checkpoint, True)
    prompts = [random_prompt(n, seed=70 + n) for n in (3, 9)]
    longer = [p + random_prompt(1, seed=80 + i) for i, p in enumerate(prompts)]
    for engine in (plain, kernel):
        forward(engine, prompts)  # the prefill (more than 4 rows: oneDNN in both)
    decode = [len(p) - 1 for p in longer]
    # Two decode rows: the kernel's path. bf16 logits of a random model are O(1); a few roundings apart.
    for a, b in zip(forward(plain, longer, decode), forward(kernel, longer, decode)):
        assert (a.float() - b.float()).abs().max().item() <= 0.1


@needs_kernel
def test_engine_with_the_kernel_generates_text_like_the_plain_one(checkpoint):
    """Greedy tokens agree until the first near-tie: bf16 rounding orders differ, so allow a late split."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = random_prompt(12, seed=90)
    expected = make_engine(checkpoint, False).generate([prompt], params)[0]
    got = make_engine(checkpoint, True).generate([prompt], params)[0]
    assert len(got) == 16 and got[:4] == expected[:4]


HAS_AMX = "amx_bf16" in build.cpu_features()
needs_amx = pytest.mark.skipif(not HAS_AMX, reason="the CPU has no AMX-BF16")


@pytest.fixture(scope="module")
def amx():
    library = cpu_linear.load_amx()
    assert library is not None, "the AMX kernel must build and run on a CPU with AMX-BF16"
    return library


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 31, 32, 33, 47, 64, 70, 128, 300])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (352, 1024), (96, 3072)])
def test_amx_kernel_matches_float64(amx, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    reference = x.double() @ w.double().T
    out = cpu_linear.amx_linear(amx, x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # Every row and column lands in its place (a transposed or shifted tile would be far off), each
    # the float32 sum rounded once, as F.linear's.
    assert (out.double() - reference).abs().max().item() <= (F.linear(x, w).double() - reference).abs().max() * 2


@needs_amx
def test_decode_batches_and_short_prefills_go_to_amx_and_long_prefills_to_oneDNN(library, amx, monkeypatch):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).bfloat16()
    module = as_layer(linear, SmallBatchLinearMethod(library, amx))
    calls = []
    for name in ("amx_linear", "small_batch_linear"):
        kernel = getattr(cpu_linear, name)
        monkeypatch.setattr(cpu_linear, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    for rows, path in [(1, "small_batch_linear"), (2, "small_batch_linear"), (3, "amx_linear"),
                       (16, "amx_linear"), (32, "amx_linear"), (33, "amx_linear"), (128, "amx_linear"),
                       (256, "amx_linear"), (257, None), (512, None)]:
        calls.clear()
        x = torch.randn(rows, 64).bfloat16()
        out = module(x)
        assert calls == ([path] if path else [])
        reference = x.double() @ linear.weight.double().T + linear.bias.double()
        assert (out.double() - reference).abs().max().item() <= rounding_bound(reference) * 2
    assert as_layer(nn.Linear(64, 48).bfloat16(), SmallBatchLinearMethod(library, amx)).amx is None  # 48 outputs: not whole tiles
