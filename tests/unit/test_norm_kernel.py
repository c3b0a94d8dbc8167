"""The RMSNorm C kernel against the PyTorch path: bf16 bit for bit, float32 to summation order."""
import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import cpu_norm
from services.model_worker.model.layers.norm import RMSNorm, rms_norm
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def library():
    library = cpu_norm.load()
    assert library is not None, "the kernel must build here (gcc is part of the test machine)"
    return library


def shapes():
    """(x, weight): hidden states, and q/k heads cut from a fused projection (tokens strided)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 96, generator=gen) * 3
    qkv = torch.randn(4, 7 * 16, generator=gen)
    heads = qkv.split([5 * 16, 2 * 16], dim=-1)[0].view(4, 5, 16)  # 5 heads of 16, rows 7 * 16 apart
    # Rows of a multiple of 16 values take the kernel's vector loops; 40 its scalar ones. From 64 rows
    # (a prefill's), bf16 sums of squares go 16 rows at a time, the last rows four or fewer at a time.
    many_heads = torch.randn(15, 7 * 32, generator=gen)[:, :6 * 32].view(15, 6, 32)  # 90 rows
    return [(hidden, torch.randn(96, generator=gen)), (heads, torch.randn(5, 16, generator=gen)),
            (torch.randn(1, 1024, generator=gen), torch.randn(1024, generator=gen)),
            (torch.randn(3, 40, generator=gen) * 5, torch.randn(40, generator=gen)),
            (many_heads, torch.randn(6, 32, generator=gen))]


@pytest.mark.parametrize("case", range(5))
def test_bfloat16_is_bit_identical(library, case):
    x, weight = shapes()[case]
    x, weight = x.bfloat16(), weight.bfloat16()
    assert cpu_norm.supports(x, weight)
    assert torch.equal(cpu_norm.rms_norm(library, x, weight, 1e-6), rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("case", range(5))
def test_float32_matches_to_rounding(library, case):
    x, weight = shapes()[case]
    expected = rms_norm(x.double(), weight.double(), 1e-6)
    out = cpu_norm.rms_norm(library, x, weight, 1e-6)
    assert out.shape == x.shape and out.is_contiguous()
    assert ((out.double() - expected).abs() / expected.abs().clamp(min=1)).max().item() <= 1e-6


def test_a_prefills_sixteen_row_sums_equal_one_rows_sums(library):
    """From 64 bf16 rows, sums of squares go 16 rows at a time, one per vector lane: each row's sum is
    added in the same order as alone (one row takes the scalar loop), so every output bit agrees.
    Against torch, whose float32 mean adds in another order, 1024-wide rows are within one bf16 step."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(70, 1024, generator=gen) * torch.rand(70, 1, generator=gen) * 8).bfloat16()
    weight = torch.randn(1024, generator=gen).bfloat16()
    together = cpu_norm.rms_norm(library, x, weight, 1e-6)
    alone = torch.cat([cpu_norm.rms_norm(library, x[i:i + 1], weight, 1e-6) for i in range(70)])
    assert torch.equal(together, alone)
    reference = rms_norm(x, weight, 1e-6).float()
    assert ((together.float() - reference).abs() <= reference.abs() * 2 ** -7).all()


def test_layouts_it_cannot_take_use_torch(library):
    x = torch.randn(8, 4, 16).transpose(0, 1)  # heads not contiguous within a token
    assert not cpu_norm.supports(x, torch.randn(16))
    norm = RMSNorm(16, 1e-6)
    norm.kernel = library
    with torch.no_grad():
        assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))


def test_engine_points_every_norm_at_the_kernel_on_cpu(tmp_path):
    make_checkpoint(tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", num_blocks=16, block_size=8))
    norms = [m for m in engine.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.kernel is not None for m in norms)
    off = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", num_blocks=16, block_size=8,
                                           norm_kernel=False))
    assert all(m.kernel is None for m in off.model.modules() if isinstance(m, RMSNorm))


def rope_case(dtype, dim=32, tokens=6):
    """q and k heads cut from a fused projection, their norm weights, and the rotary tables at scattered positions."""
    from services.model_worker.config.model import Qwen3Config
    from services.model_worker.model.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads = 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    x = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)[0].view(tokens, heads + kv_heads, dim)
    weight = torch.cat((torch.randn(dim, generator=gen).expand(heads, -1),
                        torch.randn(dim, generator=gen).expand(kv_heads, -1)))
    config = Qwen3Config(vocab_size=64, hidden_size=heads * dim, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim,
                         max_position_embeddings=4096, rope_theta=1e6)
    rope = RotaryEmbedding(config)(torch.tensor([0, 3, 17, 511, 2047, 4000] * (tokens // 6)), dtype)
    return x.to(dtype), weight.to(dtype), rope


# Head sizes: 32 and 128 (Qwen3's) take the kernel's vector loops, 16 and 48 too with halves that are not whole
# vectors, 24 its scalar ones; 18 tokens (108 rows of heads) a prefill's 16-row sums.
@pytest.mark.parametrize("tokens", [6, 18])
@pytest.mark.parametrize("dim", [16, 24, 32, 48, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_norm_and_rotary_equal_the_torch_ops(library, dtype, dim, tokens):
    from services.model_worker.model.layers.norm import norm_and_rotate
    from services.model_worker.model.layers.rotary import apply_rotary

    x, weight, rope = rope_case(dtype, dim, tokens)
    assert cpu_norm.supports_rope(x, weight, rope)
    fused = norm_and_rotate(x, weight, 1e-6, rope, library)
    if dtype == torch.bfloat16:  # every step rounded as the torch ops round it
        assert torch.equal(fused, apply_rotary(rms_norm(x, weight, 1e-6), rope))
    else:  # the norm's sum may be ordered differently; the rotation adds no error of its own
        unfused = apply_rotary(cpu_norm.rms_norm(library, x, weight, 1e-6), rope)
        assert torch.equal(fused, unfused)
        reference = apply_rotary(rms_norm(x.double(), weight.double(), 1e-6), tuple(t.double() for t in rope))
        assert (fused.double() - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()


@pytest.mark.parametrize("rotate", [False, True])
def test_bfloat16_nan_and_overflow_come_out_where_torch_puts_them(library, rotate):
    """The wide rows' rounding has no NaN case of its own (rms_norm.c, fast_round): a NaN in a row, and
    a weight so large its products overflow to infinity (whose rotation then subtracts infinities), give
    NaN and infinity in the places the torch ops give them, and every other value to the bit."""
    x, weight, rope = rope_case(torch.bfloat16, dim=128, tokens=18)
    x = x.clone()
    x[3, 1, 7] = float("nan")  # token 3's second head: NaN throughout
    weight = weight.clone()
    weight[0, 5] = 3e38  # the first q head's value 5 (and, rotated, 69) overflow in every token
    if rotate:
        from services.model_worker.model.layers.norm import norm_and_rotate
        from services.model_worker.model.layers.rotary import apply_rotary
        out, expected = norm_and_rotate(x, weight, 1e-6, rope, library), apply_rotary(rms_norm(x, weight, 1e-6), rope)
    else:
        out, expected = cpu_norm.rms_norm(library, x, weight, 1e-6), rms_norm(x, weight, 1e-6)
    assert out.isnan().any() and out.isinf().any()
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])
