"""The int8 x int8 C kernels (w8a8_linear.c: AMX-INT8 tiles, AVX512-VNNI) against a reference that quantizes
the activations the same way, the layer's routing to them, and an int8 model end to end through them."""
import pytest
import torch
import torch.nn.functional as F

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_q8_linear
from services.model_worker.model.layers.linear import ReplicatedLinear, use_linear_method
from services.model_worker.model.layers.quant.eight_bit import EightBitLinearMethod, int8_weight
from services.model_worker.model.layers.quant.quantize import dequantize, pack_int8_vnni, unpack_int8_vnni
from tests.checkpoints import make_checkpoint
from tests.unit.test_engine_reference import random_prompt

pytestmark = pytest.mark.skipif("avx512f" not in build.cpu_features(), reason="the CPU has no AVX-512")
features = build.cpu_features().split()
needs_amx_int8 = pytest.mark.skipif("amx_int8" not in features, reason="the CPU has no AMX-INT8")
needs_vnni = pytest.mark.skipif("avx512_vnni" not in features, reason="the CPU has no AVX512-VNNI")


@pytest.fixture(scope="module")
def kernels():
    kernels = cpu_q8_linear.load()
    assert kernels is not None and kernels.w8a8 is not None, "the kernels must build (gcc is on the test machine)"
    return kernels


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row to int8 values: scale max|row| / 127 in float32, x / scale rounded half to even; 0 for a zero row."""
    xf = x.float()
    scales = xf.abs().amax(1, keepdim=True) / 127
    return torch.where(scales > 0, torch.round(xf / scales), torch.zeros_like(xf)), scales


def exact(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64: the exact product of the quantized rows and the weight, times both scales."""
    xq, x_scales = quantize_rows(x)
    return (xq.double() @ q.double().T) * scales.double().T * x_scales.double()


def rounded_as_the_kernels(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic in torch: exact integer sums (< 2^53 in float64), then float32(sum) * w_scale * x_scale
    in float32 in that order, rounded to bf16 once."""
    xq, x_scales = quantize_rows(x.reshape(-1, x.shape[-1]))
    sums = (xq.double() @ q.double().T).float()
    return (sums * scales.T * x_scales).bfloat16().view(*x.shape[:-1], q.shape[0])


def bf16_ulp(value: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers (8 significant bits) at each value."""
    return torch.ldexp(torch.ones_like(value), torch.frexp(value)[1] - 8)


def check(out: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    reference = exact(x, q, scales)
    assert out.dtype == torch.bfloat16 and out.shape == reference.shape
    assert ((out.double() - reference).abs() <= bf16_ulp(reference)).all()  # one rounding to bf16, and float32's
    assert torch.equal(out, rounded_as_the_kernels(x, q, scales))


def weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, 1, generator=gen) + 0.01


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()
    x[rows // 2] = 0  # a zero row: scale 0, no division by it
    return x


@needs_amx_int8
@pytest.mark.parametrize("n,k", [(64, 128), (96, 160), (32, 1024), (64, 96)])  # k = 160, 96: a half step of 64
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 47, 64, 100, 130])
def test_amx_int8_kernel_matches_the_quantized_product(kernels, n, k, rows):
    q, scales = weights(n, k, seed=n + k + rows)
    x = activations(rows, k, seed=rows)
    check(cpu_q8_linear.w8a8_linear(kernels, x, q, scales, amx=True), x, q, scales)


@needs_amx_int8
def test_amx_int8_kernel_takes_long_prompts_in_chunks(kernels):
    """Over 512 rows the kernel runs the rows in chunks; 1,100 rows cross two chunk edges."""
    q, scales = weights(64, 128, seed=5)
    x = activations(1100, 128, seed=5)
    check(cpu_q8_linear.w8a8_linear(kernels, x, q, scales, amx=True), x, q, scales)


@needs_vnni
@pytest.mark.parametrize("n,k", [(64, 128), (48, 160), (208, 1024), (16, 96)])  # groups of 64 outputs and a narrower last one
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 17, 64, 100, 400])  # 400: chunks of 192 rows
def test_vnni_kernel_matches_the_quantized_product(kernels, n, k, rows):
    q, scales = weights(n, k, seed=n + k + rows)
    x = activations(rows, k, seed=rows + 1)
    if rows > 1:
        x[0] = 0
    check(vnni_linear(kernels, x, q, scales), x, q, scales)


def vnni_linear(kernels, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return cpu_q8_linear.w8a8_linear(kernels, x, pack_int8_vnni(q), scales, amx=False)


def test_vnni_order_puts_each_weight_where_the_kernel_reads_it():
    """Byte n0 * K + (k // 4) * width * 4 + (n - n0) * 4 + k % 4 holds w[n, k] + 128, n0 the group of 64 outputs
    holding n and width its size (the last group N % 64 wide); unpacking gives the weight back."""
    n, k = 80, 12
    q = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    packed = pack_int8_vnni(q)
    assert packed.dtype == torch.uint8 and packed.shape == (n * k,)
    for row in range(n):
        n0 = row // 64 * 64
        width = min(64, n - n0)
        for col in range(k):
            assert packed[n0 * k + col // 4 * width * 4 + (row - n0) * 4 + col % 4].item() == q[row, col].item() + 128
    assert torch.equal(unpack_int8_vnni(packed, n), q)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_int8_vnni(q[:40])


@pytest.mark.parametrize("amx", [pytest.param(True, marks=needs_amx_int8), pytest.param(False, marks=needs_vnni)])
def test_activation_ties_round_half_to_even(kernels, amx):
    """With max|row| = 127 the scale is 1 and an identity weight returns the quantized row itself: ties go to
    the even neighbour (0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -2.5 -> -2), as torch.round does, not away from zero."""
    k = 64
    ties = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, -3.5, 126.5, -126.5, 127.0])
    x = torch.zeros(2, k)
    x[:, :ties.numel()] = ties
    x[1, 10] = -127.0  # the largest magnitude negative
    identity = torch.eye(k, dtype=torch.int8)
    x = x.bfloat16()
    out = cpu_q8_linear.w8a8_linear(kernels, x, identity, torch.ones(k, 1), amx=True) if amx \
        else vnni_linear(kernels, x, identity, torch.ones(k, 1))
    expected = torch.zeros(2, k)
    expected[:, :ties.numel()] = torch.tensor([0.0, 2, 2, 4, 0, -2, -2, -4, 126, -126, 127])
    expected[1, 10] = -127
    assert torch.equal(out.float(), expected)


@pytest.mark.parametrize("amx", [pytest.param(True, marks=needs_amx_int8), pytest.param(False, marks=needs_vnni)])
def test_what_the_kernels_do_not_take_is_refused(kernels, amx):
    q, scales = weights(64, 128, seed=0)
    x = torch.randn(3, 128).bfloat16()
    fp8 = torch.randn(64, 128).to(torch.float8_e4m3fn)
    kernel = kernels.w8a8.w8a8_linear_amx if amx else kernels.w8a8.w8a8_linear
    with pytest.raises(RuntimeError, match="failed"):
        cpu_q8_linear._call(kernel, x, fp8, scales, 128)  # fp8 weights
    with pytest.raises(RuntimeError, match="failed"):
        cpu_q8_linear._call(kernel, x, q, torch.ones(64, 2), 64)  # blocks of scales along k
    with pytest.raises(RuntimeError, match="failed"):  # n not a multiple of 32 (AMX) or 16 (VNNI)
        cpu_q8_linear._call(kernel, x, q[:40], scales[:40], 128)


def int8_layer(kernels, int8_activations: bool, bias: bool = False) -> ReplicatedLinear:
    torch.manual_seed(0)
    layer = ReplicatedLinear(256, 96, bias=bias).bfloat16()
    for p in layer.parameters():
        p.data.normal_()
    use_linear_method(layer, EightBitLinearMethod("int8", False, kernels, int8_activations=int8_activations))
    return layer


def count_calls(monkeypatch) -> list:
    calls = []
    for name in ("linear", "w8a8_linear"):
        real = getattr(cpu_q8_linear, name)
        monkeypatch.setattr(cpu_q8_linear, name, lambda *a, _n=name, _r=real, **kw: (
            calls.append((_n, kw.get("amx"))), _r(*a, **kw))[1])
    return calls


@needs_amx_int8
def test_the_int8_layer_takes_the_amx_int8_kernel_at_every_row_count(kernels, monkeypatch):
    layer = int8_layer(kernels, int8_activations=True)
    assert layer.w8a8_amx and "a8" in layer.method.name
    calls = count_calls(monkeypatch)
    for rows in (1, 4, 5, 100, 200):
        x = torch.randn(rows, 256).bfloat16()
        assert torch.equal(layer(x), rounded_as_the_kernels(x, layer.weight, layer.weight_scale_inv))
    assert calls == [("w8a8_linear", True)] * 5


def without_amx_int8(kernels) -> cpu_q8_linear.Q8Kernels:
    no_amx = cpu_q8_linear.Q8Kernels(kernels.library, kernels.amx, kernels.w8a8)
    no_amx.w8a8_amx = False
    return no_amx


@needs_vnni
def test_without_amx_int8_the_layer_packs_its_weight_and_takes_vnni_at_every_row_count(kernels, monkeypatch):
    reference = int8_layer(kernels, int8_activations=False)  # the same quantized weight, held as (N, K)
    layer = int8_layer(without_amx_int8(kernels), int8_activations=True, bias=True)
    assert layer.w8a8_vnni and not layer.w8a8_amx and layer.weight.dtype == torch.uint8
    assert torch.equal(int8_weight(layer), reference.weight)
    calls = count_calls(monkeypatch)
    for rows in (1, 4, 5, 16, 100):
        x = torch.randn(rows, 256).bfloat16()
        expected = rounded_as_the_kernels(x, reference.weight, layer.weight_scale_inv) + layer.bias
        assert torch.equal(layer(x), expected)
    assert calls == [("w8a8_linear", False)] * 5
    x = torch.randn(3, 256)  # float32: F.linear on the float32 dequantization of the unpacked weight
    assert torch.equal(layer(x), F.linear(x, dequantize(reference.weight, layer.weight_scale_inv, 256, torch.float32),
                                          layer.bias.float()))


@needs_vnni
def test_a_layer_vnni_cannot_take_keeps_its_weight_and_bf16_activations(kernels, monkeypatch):
    torch.manual_seed(0)
    layer = ReplicatedLinear(256, 40, bias=False).bfloat16()  # 40 outputs: not a multiple of 16
    use_linear_method(layer, EightBitLinearMethod("int8", False, without_amx_int8(kernels)))
    assert not layer.w8a8_vnni and layer.weight.shape == (40, 256) and layer.weight.dtype == torch.int8
    calls = count_calls(monkeypatch)
    layer(torch.randn(2, 256).bfloat16())
    assert calls == [("linear", False)]


def test_with_int8_activations_off_or_fp8_the_kernels_are_not_used(kernels, monkeypatch):
    calls = count_calls(monkeypatch)
    layer = int8_layer(kernels, int8_activations=False)
    assert not layer.w8a8_amx and not layer.w8a8_vnni
    for rows in (1, 9):
        layer(torch.randn(rows, 256).bfloat16())
    fp8 = ReplicatedLinear(256, 96, bias=False).bfloat16()
    use_linear_method(fp8, EightBitLinearMethod("fp8", False, kernels))
    assert not fp8.w8a8_amx and not fp8.w8a8_vnni
    fp8(torch.randn(9, 256).bfloat16())
    assert [name for name, _ in calls] == ["linear"] * 3


def load_without_amx_int8(monkeypatch) -> None:
    real_load = cpu_q8_linear.load
    monkeypatch.setattr(cpu_q8_linear, "load", lambda: without_amx_int8(real_load()))


@pytest.mark.parametrize("amx", [pytest.param(True, marks=needs_amx_int8), pytest.param(False, marks=needs_vnni)])
def test_an_int8_model_runs_through_the_kernels_as_the_reference_rounds(tmp_path, monkeypatch, amx):
    """The engine in bf16 with int8 weights (fused decode loop and all) against the same engine with every 8-bit
    matmul done by the torch reference, layer by layer: the same greedy tokens and the same logits, bit for bit.
    Without AMX-INT8 the weights, the head's among them, are packed for VNNI."""
    if not amx:
        load_without_amx_int8(monkeypatch)
    make_checkpoint(tmp_path, eos_token_id=(), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, hidden_size=128, intermediate_size=192)
    prompts = [random_prompt(5 + 6 * i, seed=i) for i in range(3)]

    def run(fused: bool) -> tuple[list, list]:
        engine = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64, block_size=8,
                                                  fused_decode=fused, quantization="int8", quantize_lm_head=True))
        logits = []
        compute_logits = engine.model.compute_logits
        engine.model.compute_logits = lambda hidden: (logits.append(compute_logits(hidden)), logits[-1])[1]
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        return outs, logits

    calls = count_calls(monkeypatch)
    tokens, logits = run(fused=True)
    assert calls and all(call == ("w8a8_linear", amx) for call in calls)  # prefill and the head, layer by layer
    monkeypatch.setattr(cpu_q8_linear, "w8a8_linear", lambda kernels, x, weight, scales, amx: rounded_as_the_kernels(
        x, weight if amx else unpack_int8_vnni(weight, scales.shape[0]), scales))
    reference_tokens, reference_logits = run(fused=False)
    assert tokens == reference_tokens
    assert len(logits) == len(reference_logits) and all(torch.equal(a, b) for a, b in zip(logits, reference_logits))


def test_the_engine_flag_turns_the_int8_activations_off(tmp_path):
    make_checkpoint(tmp_path, num_hidden_layers=1, hidden_size=128, intermediate_size=192, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32)

    def linears(**flags) -> list:
        engine = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16, block_size=8,
                                                  quantization="int8", quantize_lm_head=True, **flags))
        return [m for m in engine.model.modules() if hasattr(m, "w8a8_amx")]

    off = linears(int8_activations=False)
    assert off and not any(m.w8a8_amx or m.w8a8_vnni for m in off)
    if "amx_int8" in features:
        assert all(m.w8a8_amx for m in linears())


@needs_vnni
@pytest.mark.parametrize("batch", [2, 6, 12, 20])
def test_without_amx_int8_fused_decode_takes_vnni_steps_and_equals_the_layers(tmp_path, monkeypatch, batch):
    """Where only VNNI is there, the fused loop takes decode steps of any size (12 rows and past the bf16 kernels'
    16 included), every matmul on the VNNI kernel as the layers route it: the hidden states are the
    layer-by-layer ones, bit for bit."""
    from services.model_worker.kernels import cpu_decoder
    from tests.unit.test_fused_decode import hidden_states

    load_without_amx_int8(monkeypatch)
    make_checkpoint(tmp_path, eos_token_id=(), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, hidden_size=128, intermediate_size=192)

    def engine(fused: bool) -> LLMEngine:
        return LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=256, block_size=8,
                                                fused_decode=fused, quantization="int8"))

    prompts = [random_prompt(3 + 4 * i, seed=40 + i) for i in range(batch)]
    plain = hidden_states(engine(False), prompts, 4)
    calls = []
    real = cpu_decoder.decode_layers
    monkeypatch.setattr(cpu_decoder, "decode_layers", lambda *args: (calls.append(args[4].shape[0]), real(*args))[1])
    fused_engine = engine(True)
    linear = fused_engine.model.model.layers[0].mlp.down_proj
    assert linear.w8a8_vnni and not linear.w8a8_amx and fused_engine.model.model.fused_decode.max_rows == 2 ** 30
    fused = hidden_states(fused_engine, prompts, 4)
    assert calls == [batch] * 3
    assert len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))


@needs_vnni
@pytest.mark.parametrize("scenario", ["fresh prompts together", "chunked beside decodes", "a prefix-cache hit"])
def test_without_amx_int8_steps_with_prompts_run_in_the_c_loop_and_equal_the_layers(tmp_path, monkeypatch, scenario):
    """int8 weights times int8 activations take every row count, so steps with prompts run in the fused loop as
    bf16 VNNI weights do: fresh prompts, chunks over cached keys beside decoding rows, a prefix-cache hit; the
    hidden states are the layer-by-layer ones, bit for bit."""
    from services.model_worker.kernels import cpu_decoder
    from tests.unit.test_fused_decode import SCENARIOS, staggered_hidden

    load_without_amx_int8(monkeypatch)
    make_checkpoint(tmp_path, eos_token_id=(), num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, hidden_size=128, intermediate_size=192)
    budget, arrivals = SCENARIOS[scenario]

    def engine(fused: bool) -> LLMEngine:
        return LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=256, block_size=8,
                                                fused_decode=fused, quantization="int8",
                                                limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=budget)))

    plain = staggered_hidden(engine(False), arrivals, 5)
    steps = []
    real = cpu_decoder.prompt_layers
    monkeypatch.setattr(cpu_decoder, "prompt_layers", lambda *args: steps.append(args[4].shape[0]) or real(*args))
    fused_engine = engine(True)
    assert fused_engine.model.model.fused_decode.prompts
    fused = staggered_hidden(fused_engine, arrivals, 5)
    assert steps, "no step with prompts went through the C loop"
    assert len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))
