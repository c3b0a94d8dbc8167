"""The RMSNorm C kernel against the PyTorch path: bf16 bit for bit, float32 to summation order."""
import pytest
import torch

from services.model_worker.engine import EngineConfig, LLMEngine
from services.model_worker.kernels import cpu_norm
from services.model_worker.models.qwen3 import RMSNorm, rms_norm
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
    return [(hidden, torch.randn(96, generator=gen)), (heads, torch.randn(5, 16, generator=gen)),
            (torch.randn(1, 1024, generator=gen), torch.randn(1024, generator=gen))]


@pytest.mark.parametrize("case", range(3))
def test_bfloat16_is_bit_identical(library, case):
    x, weight = shapes()[case]
    x, weight = x.bfloat16(), weight.bfloat16()
    assert cpu_norm.supports(x, weight)
    assert torch.equal(cpu_norm.rms_norm(library, x, weight, 1e-6), rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("case", range(3))
def test_float32_matches_to_rounding(library, case):
    x, weight = shapes()[case]
    expected = rms_norm(x.double(), weight.double(), 1e-6)
    out = cpu_norm.rms_norm(library, x, weight, 1e-6)
    assert out.shape == x.shape and out.is_contiguous()
    assert ((out.double() - expected).abs() / expected.abs().clamp(min=1)).max().item() <= 1e-6


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
