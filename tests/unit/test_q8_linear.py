"""The 8-bit-weight C kernels (int8 rows, fp8 blocks) against float64 on the dequantized weights, and the layer's routing."""
import pytest
import torch
import torch.nn.functional as F

from services.model_worker.kernels import build, cpu_q8_linear
from services.model_worker.model.layers.linear import ReplicatedLinear, use_linear_method
from services.model_worker.model.layers.quant.eight_bit import EightBitLinearMethod
from services.model_worker.model.layers.quant.quantize import dequantize

needs_avx512 = pytest.mark.skipif("avx512f" not in build.cpu_features(), reason="the CPU has no AVX-512")


@pytest.fixture(scope="module")
def kernels():
    kernels = cpu_q8_linear.load()
    assert kernels is not None, "the kernels must build on a CPU with AVX-512 (gcc is on the test machine)"
    return kernels


def weights(fmt: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(seed)
    if fmt == "int8":
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return q, torch.rand(n, 1, generator=gen) + 0.01, k
    q = (torch.randn(n, k, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    bits = q.view(torch.uint8)
    bits[0, :32] = torch.arange(32, dtype=torch.uint8)  # zero, every subnormal, the smallest normals
    bits[-1, :32] = torch.arange(32, dtype=torch.uint8) | 0x80  # and their negatives
    bits[n // 2, :2] = torch.tensor([0x7E, 0xFE], dtype=torch.uint8)  # +-448
    return q, torch.rand(n, -(-k // 128), generator=gen) + 0.01, 128


def bound(reference: torch.Tensor) -> float:
    """bf16 rounding of the output and float32 (and, on AMX, bf16 weight) rounding along the sum."""
    return reference.abs().max().item() * 2 ** -7 + 1e-3


@needs_avx512
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("n,k", [(64, 160), (96, 1024), (40, 288)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 40])
def test_kernels_match_float64_on_the_dequantized_weight(kernels, fmt, n, k, rows):
    q, scales, block_k = weights(fmt, n, k, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    reference = x.double() @ dequantize(q, scales, block_k, torch.float64).T
    out = cpu_q8_linear.linear(kernels, x, q, scales, block_k, amx=False)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    assert (out.double() - reference).abs().max().item() <= bound(reference)
    if kernels.amx and n % 32 == 0 and k % 32 == 0:
        out = cpu_q8_linear.linear(kernels, x, q, scales, block_k, amx=True)
        assert (out.double() - reference).abs().max().item() <= bound(reference)


@needs_avx512
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_dequantize_equals_torch_bit_for_bit(kernels, fmt):
    q, scales, block_k = weights(fmt, 48, 288, seed=3)
    assert torch.equal(cpu_q8_linear.dequantize(kernels, q, scales, block_k),
                       dequantize(q, scales, block_k, torch.bfloat16))


@needs_avx512
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_layer_routes_every_row_count_to_a_correct_path(kernels, fmt):
    torch.manual_seed(0)
    layer = ReplicatedLinear(256, 96, bias=True).bfloat16()
    for p in layer.parameters():
        p.data.normal_()
    # int8 with bf16 activations (the int8 x int8 kernels are test_w8a8_linear.py's)
    use_linear_method(layer, EightBitLinearMethod(fmt, False, kernels, int8_activations=False))
    assert layer.weight.element_size() == 1 and layer.q8 is kernels and not layer.w8a8_amx and not layer.w8a8_vnni
    reference_weight = dequantize(layer.weight, layer.weight_scale_inv, layer.block_k, torch.float64)
    for rows in (1, 4, 9, 100, 200):  # AVX-512, AVX-512, AMX (or AVX-512), AMX, oneDNN on a dequantized copy
        x = torch.randn(rows, 256).bfloat16()
        reference = x.double() @ reference_weight.T + layer.bias.double()
        out = layer(x)
        assert (out.double() - reference).abs().max().item() <= bound(reference) * 2
    x = torch.randn(3, 256)  # float32: F.linear on the float32 dequantization, exactly
    assert torch.equal(layer(x), F.linear(x, dequantize(layer.weight, layer.weight_scale_inv, layer.block_k,
                                                        torch.float32), layer.bias.float()))


@needs_avx512
@pytest.mark.parametrize("fmt,batch,int8_activations", [("fp8", 1, True), ("int8", 3, False), ("fp8", 6, True),
                                                         ("int8", 2, True), ("int8", 6, True)])
def test_fused_decode_steps_equal_the_layer_by_layer_forward_bit_for_bit(tmp_path, fmt, batch, int8_activations,
                                                                         monkeypatch):
    """The fused decode loop (kernels/decoder.c) calls the same 8-bit kernels with the same routing: AVX-512 at
    1-4 rows, AMX at 6; int8 with int8 activations the int8 x int8 kernels (w8a8_linear.c) at every row count
    on AMX-INT8, at 1-4 rows on VNNI alone."""
    from services.model_worker.config.engine import EngineConfig
    from services.model_worker.engine.llm_engine import LLMEngine
    from tests.checkpoints import make_checkpoint
    from tests.unit.test_engine_reference import random_prompt
    from tests.unit.test_fused_decode import hidden_states

    make_checkpoint(tmp_path, eos_token_id=(), num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=32, hidden_size=160, intermediate_size=288)

    def make_engine(fused: bool) -> LLMEngine:
        return LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=256, block_size=8,
                                                fused_decode=fused, quantization=fmt,
                                                int8_activations=int8_activations))

    prompts = [random_prompt(3 + 4 * i, seed=batch * 10 + i) for i in range(batch)]
    plain = hidden_states(make_engine(False), prompts, 5)
    from services.model_worker.kernels import cpu_decoder
    calls = []
    real = cpu_decoder.decode_layers
    monkeypatch.setattr(cpu_decoder, "decode_layers", lambda *args: (calls.append(args[4].shape[0]), real(*args))[1])
    engine = make_engine(True)
    fused = hidden_states(engine, prompts, 5)
    assert calls and set(calls) == {batch}  # every decode step went through the fused loop
    assert len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))
