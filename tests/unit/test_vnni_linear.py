"""The matmul kernels on VNNI-ordered weights (vnni_linear.c) against float64 and the plain-weight kernels,
and VnniLinearMethod in the layers and the engine."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.config.engine import EngineConfig
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_linear
from services.model_worker.model.layers.linear import (SmallBatchLinearMethod, VnniLinearMethod, cpu_linear_method,
                                                       linear_layers)
from tests.checkpoints import make_checkpoint
from tests.unit.test_optimize import as_layer
from tests.unit.test_small_batch_linear import rounding_bound

pytestmark = pytest.mark.skipif("avx512_bf16" not in build.cpu_features(), reason="the CPU has no AVX512-BF16")
AMX = "amx_bf16" in build.cpu_features()


@pytest.fixture(scope="module")
def vnni():
    library = cpu_linear.load_vnni()
    assert library is not None, "the VNNI kernels must build and run on a CPU with AVX512-BF16"
    return library


@pytest.fixture(scope="module")
def plain():
    return cpu_linear.load(), cpu_linear.load_amx()


def reordered(w: torch.Tensor) -> torch.Tensor:
    """The VNNI order written with torch: blocks of 16 rows, each input pair of the 16 side by side."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("n,k", [(32, 32), (96, 288), (352, 1024)])
def test_pack_reorders_in_place_as_torch_would(vnni, n, k):
    w = torch.randn(n, k).bfloat16()
    storage = w.clone()
    packed = cpu_linear.vnni_pack_(vnni, storage)
    assert packed.data_ptr() == storage.data_ptr() and packed.shape == (n // 16, k // 2, 16, 2)
    assert torch.equal(packed, reordered(w))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 10, 13, 16, 17, 31, 32, 33, 64, 65, 128, 200, 256, 257, 300, 513])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (96, 288), (352, 1024), (64, 3072)])
def test_kernel_matches_float64_and_the_plain_kernels(vnni, plain, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    reference = x.double() @ w.double().T
    out = cpu_linear.vnni_linear(vnni, x, cpu_linear.vnni_pack_(vnni, w.clone()))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    # Every output in its place, each a float32 sum rounded once, as F.linear's.
    assert (out.double() - reference).abs().max().item() <= (F.linear(x, w).double() - reference).abs().max() * 2
    small, amx = plain
    if rows >= 3 and amx is not None:
        # The same tile products as the AMX kernel on the plain weight, in the same order: the same bits.
        assert torch.equal(out, cpu_linear.amx_linear(amx, x, w))


def test_one_and_two_rows_sum_each_output_in_input_order(vnni):
    """The decode kernels add each output's input pairs in order in float32: exact where every partial sum is."""
    gen = torch.Generator().manual_seed(5)
    # Small integers: every product and partial sum is exact in float32, so any order gives the same sum,
    # and the bf16 output (within 2^8) is exact too: a misplaced pair or output shows as a wrong integer.
    x = torch.randint(-3, 4, (2, 256), generator=gen).bfloat16()
    w = torch.randint(-3, 4, (64, 256), generator=gen).bfloat16()
    packed = cpu_linear.vnni_pack_(vnni, w.clone())
    expected = (x.double() @ w.double().T)
    assert expected.abs().max() < 256
    assert torch.equal(cpu_linear.vnni_linear(vnni, x[:1], packed).double(), expected[:1])
    assert torch.equal(cpu_linear.vnni_linear(vnni, x, packed).double(), expected)


@pytest.mark.parametrize("rows", [3, 4, 6, 7, 13, 64, 130])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (96, 288), (352, 1024), (64, 3072)])
def test_register_tiles_without_amx_match_float64_and_give_each_row_its_own_bits(vnni, rows, out_features,
                                                                                   in_features):
    """What a CPU without AMX runs from three rows (AVX512-BF16 register tiles of 6 rows by 64 outputs, 32 at
    the edge): each output's input pairs added in order, as the one-row kernel adds them, so every row gets
    the bits it gets alone, whatever rows share the call (a decode step's or a prompt's)."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    packed = cpu_linear.vnni_pack_(vnni, w.clone())
    out = cpu_linear.vnni_linear_avx512(vnni, x, packed)
    reference = x.double() @ w.double().T
    assert out.shape == (rows, out_features)
    assert (out.double() - reference).abs().max().item() <= (F.linear(x, w).double() - reference).abs().max() * 2
    alone = torch.cat([cpu_linear.vnni_linear_avx512(vnni, x[i:i + 1], packed) for i in range(rows)])
    assert torch.equal(out, alone)
    if not AMX:  # what vnni_linear runs here
        assert torch.equal(cpu_linear.vnni_linear(vnni, x, packed), out)


def test_register_tiles_sum_each_output_in_input_order(vnni):
    """Small integers: exact in any order, so a misplaced pair, row or output shows as a wrong integer."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randint(-3, 4, (13, 256), generator=gen).bfloat16()
    w = torch.randint(-3, 4, (96, 256), generator=gen).bfloat16()
    expected = x.double() @ w.double().T
    assert expected.abs().max() < 256
    out = cpu_linear.vnni_linear_avx512(vnni, x, cpu_linear.vnni_pack_(vnni, w.clone()))
    assert torch.equal(out.double(), expected)


def test_leading_shapes_and_bad_inputs(vnni):
    w = torch.randn(64, 96).bfloat16()
    packed = cpu_linear.vnni_pack_(vnni, w.clone())
    x = torch.randn(2, 3, 96).bfloat16()
    flat = cpu_linear.vnni_linear(vnni, x.reshape(6, 96), packed)
    assert torch.equal(cpu_linear.vnni_linear(vnni, x, packed), flat.view(2, 3, 64))
    with pytest.raises(ValueError, match="width 64"):
        cpu_linear.vnni_linear(vnni, torch.randn(3, 64).bfloat16(), packed)
    # 48 outputs are not whole tile pairs: the kernel refuses rather than reading past the weight.
    with pytest.raises(RuntimeError, match="status -1"):
        cpu_linear._call(vnni.vnni_linear, torch.randn(3, 96).bfloat16(), torch.randn(48, 96).bfloat16())


@pytest.fixture(params=[1, 2])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)  # the kernels run on torch's OpenMP pool
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 16, 17, 32, 33, 65, 257])
@pytest.mark.parametrize("out_features,in_features", [(32, 32), (192, 64), (704, 1024), (128, 3072)])
def test_silu_kernel_gives_torchs_silu_of_the_matmul(vnni, threads, rows, out_features, in_features):
    """vnni_linear_silu against F.silu(gate) * up in torch on vnni_linear's output: the same bits, at every
    row count (each block's results are written during the next block's products; with 2 steps of 32
    inputs, fewer steps than rows, after them) and on one thread or two."""
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = cpu_linear.vnni_pack_(vnni, (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16())
    gate, up = cpu_linear.vnni_linear(vnni, x, packed).chunk(2, dim=-1)
    act = cpu_linear.vnni_linear_silu(vnni, x, packed)
    assert act.shape == (rows, out_features // 2)
    assert torch.equal(act, F.silu(gate) * up)


def test_silu_kernel_shapes(vnni):
    packed = cpu_linear.vnni_pack_(vnni, torch.randn(64, 96).bfloat16())
    x = torch.randn(2, 5, 96).bfloat16()
    assert torch.equal(cpu_linear.vnni_linear_silu(vnni, x, packed),
                       cpu_linear.vnni_linear_silu(vnni, x.reshape(10, 96), packed).view(2, 5, 32))
    with pytest.raises(ValueError, match="width 64"):
        cpu_linear.vnni_linear_silu(vnni, torch.randn(3, 64).bfloat16(), packed)
    # 48 outputs: three blocks of 16 do not split into gate and up.
    with pytest.raises(ValueError, match="gate and up"):
        cpu_linear.vnni_linear_silu(vnni, x, torch.randn(3, 48, 16, 2).bfloat16())


def test_gate_up_layer_takes_the_silu_kernel_with_the_unfused_bits(vnni, plain, monkeypatch):
    from services.model_worker.model.layers.linear import MergedColumnParallelLinear, use_linear_method

    small, amx = plain
    torch.manual_seed(1)
    weight = (torch.randn(2 * 96, 64) * 0.1).bfloat16()
    layer = MergedColumnParallelLinear(64, [96, 96]).bfloat16()
    layer.weight.data.copy_(weight)
    use_linear_method(layer, VnniLinearMethod(small, amx, vnni))
    calls = []
    real = cpu_linear.vnni_linear_silu
    monkeypatch.setattr(cpu_linear, "vnni_linear_silu", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    for rows in (1, 3, 40):
        x = torch.randn(rows, 64).bfloat16()
        gate, up = layer(x).chunk(2, dim=-1)
        assert torch.equal(layer.silu_and_mul(x), F.silu(gate) * up)
    assert calls == [1, 3, 40]
    # Methods without the fused pass, and layers that are not one gate and one up of a width, say None.
    plain_layer = MergedColumnParallelLinear(64, [96, 96]).bfloat16()
    use_linear_method(plain_layer, SmallBatchLinearMethod(small, amx))
    assert plain_layer.silu_and_mul(torch.randn(3, 64).bfloat16()) is None
    uneven = MergedColumnParallelLinear(64, [96, 160]).bfloat16()
    use_linear_method(uneven, VnniLinearMethod(small, amx, vnni))
    assert uneven.silu_and_mul(torch.randn(3, 64).bfloat16()) is None


def test_method_reorders_in_place_routes_every_row_count_and_leaves_odd_layers_plain(vnni, plain, monkeypatch):
    small, amx = plain
    method = VnniLinearMethod(small, amx, vnni)
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True).bfloat16()
    weight = linear.weight.detach().clone()
    storage = linear.weight.data_ptr()
    layer = as_layer(linear, method)
    assert layer.weight is None and layer.vnni_weight.data_ptr() == storage  # no second copy
    assert torch.equal(layer.vnni_weight, reordered(weight))
    calls = []
    real = cpu_linear.vnni_linear
    monkeypatch.setattr(cpu_linear, "vnni_linear", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    for rows in (1, 2, 3, 32, 257, 600):
        x = torch.randn(rows, 64).bfloat16()
        out = layer(x)
        reference = x.double() @ weight.double().T + linear.bias.double()
        assert (out.double() - reference).abs().max().item() <= rounding_bound(reference) * 2
    assert calls == [1, 2, 3, 32, 257, 600]  # never F.linear: there is no plain weight left
    odd = as_layer(nn.Linear(64, 48).bfloat16(), method)
    assert odd.vnni is None and odd.weight is not None and odd.amx is None  # 48 outputs: plain, as before
    assert method.head_method() is method  # the vocab projection is reordered too


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vnni")
    make_checkpoint(path)  # TINY: a tied head, every width a multiple of 32
    return path


def test_the_engine_reorders_the_decoder_and_the_tied_head_whose_embedding_reads_the_same_storage(tied_checkpoint):
    from safetensors.torch import load_file

    assert isinstance(cpu_linear_method(torch.device("cpu"), torch.bfloat16, None, None), VnniLinearMethod)
    engine = LLMEngine(tied_checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16, block_size=8))
    model = engine.model
    body = linear_layers(model, include_lm_head=False)
    assert body and all(isinstance(m.method, VnniLinearMethod) and m.vnni is not None for _, m in body)
    assert model.model.fused_decode.vnni is body[0][1].vnni  # the decode loop calls vnni_linear too
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head.method, VnniLinearMethod) and head.vnni is not None and head.weight is None
    # One table, reordered in place: the embedding holds the head's tensor, and looks its rows up in that order.
    assert embedding.weight is head.vnni_weight
    tensors = load_file(str(tied_checkpoint / "model.safetensors"))
    table = tensors["model.embed_tokens.weight"].bfloat16()
    assert torch.equal(head.vnni_weight, reordered(table))
    ids = torch.tensor([0, 1, 15, 16, 17, 31, table.shape[0] - 1] + torch.randint(0, table.shape[0], (9,)).tolist())
    assert torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding(ids.view(2, 8)), table[ids].view(2, 8, -1))
    x = torch.randn(5, table.shape[1]).bfloat16()
    reference = x.double() @ table.double().T
    assert (head(x).double() - reference).abs().max().item() <= rounding_bound(reference) * 2
    # A fused layer's weight is its checkpoint parts, stacked, then reordered.
    parts = [tensors[f"model.layers.1.self_attn.{p}_proj.weight"].bfloat16() for p in "qkv"]
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.vnni_weight, reordered(torch.cat(parts)))
    off = LLMEngine(tied_checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16, block_size=8,
                                                  vnni_weights=False))
    assert all(type(m.method) is SmallBatchLinearMethod for _, m in linear_layers(off.model))
    with pytest.raises(ValueError, match="vnni_weights needs"):
        LLMEngine(tied_checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=16, block_size=8,
                                                vnni_weights=True))


def test_reordered_and_plain_engines_generate_alike(tied_checkpoint):
    """From 3 rows the reordered weights give the AMX kernel's very bits (without AMX, oneDNN's to rounding);
    1-2 rows sum in another order, so greedy tokens may part at a near-tie: they must agree at first, and
    the logits within bf16 rounding."""
    from services.model_worker.config.sampling import SamplingParams
    from tests.unit.test_engine_reference import forward, random_prompt

    engines = [LLMEngine(tied_checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64, block_size=8,
                                                       vnni_weights=flag)) for flag in (None, False)]
    prompts = [random_prompt(n, seed=40 + n) for n in (5, 40)]
    prefill = [forward(engine, prompts) for engine in engines]
    if AMX:
        assert all(torch.equal(a, b) for a, b in zip(*prefill))  # prefill rows: AMX on both, the same bits
    else:  # the register tiles against oneDNN: the same products, summed in another order
        assert all((a.float() - b.float()).abs().max() <= 0.05 * b.float().abs().max() for a, b in zip(*prefill))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    vnni, plain = (engine.generate([prompts[0]], params)[0] for engine in engines)
    assert len(vnni) == 12 and vnni[:4] == plain[:4]
