"""RoPE's per-step lookup in whole precomputed rows gives the bits the per-step concatenation gave."""
import pytest
import torch

from services.model_worker.config.model import Qwen3Config
from services.model_worker.model.layers.rotary import RotaryEmbedding, apply_rotary

SCALINGS = [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def reference(module: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
    """What forward computed before it kept the rows: look up, round, then concatenate (and negate)."""
    cos = module.cos[positions].to(dtype)[:, None, :]
    sin = module.sin[positions].to(dtype)[:, None, :]
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_rows_equal_the_lookup_then_the_concatenation_bit_for_bit(scaling, dtype):
    config = Qwen3Config(vocab_size=8, hidden_size=64, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, rope_scaling=scaling, max_position_embeddings=2048)
    module = RotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 511, 512, 2047, 3, 3], dtype=torch.int64)
    cos, signed_sin = module(positions, dtype)
    want_cos, want_sin = reference(module, positions, dtype)
    assert cos.shape == want_cos.shape == (8, 1, 64) and cos.dtype == dtype
    # Bits, not closeness (a -0.0 for a 0.0 would pass ==): every path must see the same tables.
    assert torch.equal(bits(cos), bits(want_cos)) and torch.equal(bits(signed_sin), bits(want_sin))
    x = torch.randn(8, 2, 64).to(dtype)
    assert torch.equal(apply_rotary(x, (cos, signed_sin)), apply_rotary(x, (want_cos, want_sin)))


def test_the_rows_are_rebuilt_when_the_tables_are():
    config = Qwen3Config(vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=32, max_position_embeddings=64)
    module = RotaryEmbedding(config)
    positions = torch.arange(5)
    module(positions, torch.bfloat16)
    module.config = Qwen3Config(vocab_size=8, hidden_size=32, intermediate_size=8, num_hidden_layers=1,
                                num_attention_heads=1, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                                rope_theta=10_000.0)
    module.reset_buffers()
    cos, _ = module(positions, torch.bfloat16)
    assert torch.equal(bits(cos), bits(reference(module, positions, torch.bfloat16)[0]))
