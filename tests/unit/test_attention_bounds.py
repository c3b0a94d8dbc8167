"""The C decode-attention kernel refuses block tables that point outside the KV pool, reading nothing."""
import dataclasses

import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_attention
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from tests.checkpoints import make_checkpoint

KV_HEADS, HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 16, 4, 6


@pytest.fixture(scope="module")
def kernel():
    library = cpu_attention.load()
    assert library is not None, "the C kernel must build here (gcc is part of the test machine)"
    return library


def decode(kernel, context_lens, tables, dtype=torch.float32):
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM, generator=gen).to(dtype) for _ in range(2)]
    q = torch.randn(len(context_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    return cpu_attention.paged_decode_attention(kernel, q, *caches, torch.tensor(context_lens, dtype=torch.int32),
                                                torch.tensor(tables, dtype=torch.int32), BLOCK_SIZE, HEAD_DIM ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tables_inside_the_pool_are_taken(kernel, dtype):
    # The last block of the pool, and entries past the context that hold anything at all (never read).
    out = decode(kernel, [5, 8], [[NUM_BLOCKS - 1, 0, -7], [2, 3, 10 ** 9]], dtype)
    assert out.shape == (2, HEADS, HEAD_DIM) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", [NUM_BLOCKS, -1, 2 ** 31 - 1], ids=["one_past", "negative", "huge"])
def test_a_block_outside_the_pool_is_refused(kernel, dtype, bad):
    # The bad entry is the second sequence's last block in use, so every earlier entry is fine.
    with pytest.raises(IndexError, match=f"outside the cache's {NUM_BLOCKS} blocks"):
        decode(kernel, [5, 8], [[1, 0, 0], [2, bad, 0]], dtype)


def test_a_context_longer_than_its_table_is_refused(kernel):
    with pytest.raises(IndexError, match="longer than its block table's 2 blocks"):
        decode(kernel, [3, 2 * BLOCK_SIZE + 1], [[1, 0], [2, 3]])


@pytest.mark.parametrize("fused", [False, True], ids=["layer_by_layer", "fused_decode"])
def test_an_engine_decode_step_with_a_block_outside_the_pool_raises(tmp_path, monkeypatch, fused):
    """Both callers of the kernel: the attention backend, and the fused decode loop that passes its status up."""
    if fused and "avx512_bf16" not in build.cpu_features():
        pytest.skip("the fused loop calls the AVX512-BF16 matmul kernel")
    make_checkpoint(tmp_path, eos_token_id=(), num_hidden_layers=2)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="bfloat16" if fused else "float32", num_blocks=16,
                                              block_size=8, fused_decode=fused))
    from_inputs = AttentionMetadata.from_inputs.__func__

    def one_past_the_pool_in_decodes(cls, *args, **kwargs):
        meta = from_inputs(cls, *args, **kwargs)
        if meta.max_query_len > 1:
            return meta
        return dataclasses.replace(meta, block_tables=torch.full_like(meta.block_tables, 16))

    monkeypatch.setattr(AttentionMetadata, "from_inputs", classmethod(one_past_the_pool_in_decodes))
    with pytest.raises(IndexError, match="outside the (KV cache|cache's 16 blocks)"):
        engine.generate([[3, 1, 4]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
