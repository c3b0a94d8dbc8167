"""Decode CUDA graphs: bucketing and padding on CPU (eager), capture and replay on a GPU."""
import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.executor.cuda_graphs import bucket_for, graph_batch_sizes
from services.model_worker.executor.kv_cache import KVCache
from services.model_worker.executor.model_runner import ModelRunner
from services.model_worker.executor.step_inputs import StepInputs
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from tests.checkpoints import make_checkpoint

BLOCK = 4


def test_batch_sizes_cover_every_count_up_to_the_limit():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    for limit in (1, 3, 7, 8, 9, 20, 64, 100):
        sizes = graph_batch_sizes(limit)
        for n in range(1, limit + 1):
            bucket = bucket_for(n, sizes)
            assert bucket is not None and n <= bucket <= limit
            assert bucket - n < 8  # padding never costs more than a few rows
        assert bucket_for(limit + 1, sizes) is None  # beyond the largest graph: eager


def test_padding_adds_one_token_sequences_in_the_spare_block():
    host = StepInputs.build([[5], [6], [7]], [[3, 1], [2], [0, 4, 8]], [6, 2, 9], BLOCK)
    padded = host.padded(8, 5, pad_block=99, block_size=BLOCK)
    assert padded.input_ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert padded.positions.tolist() == [5, 1, 8, 0, 0, 0, 0, 0]
    assert padded.slot_mapping.tolist() == [1 * 4 + 1, 2 * 4 + 1, 8 * 4 + 0] + [99 * 4] * 5
    assert padded.query_start_loc.tolist() == list(range(9))
    assert padded.context_lens.tolist() == [6, 2, 9, 1, 1, 1, 1, 1]
    # Entries past a context are never read; the real rows keep theirs, the rest point at the spare block.
    assert padded.block_tables.tolist() == [[3, 1, 0, 99, 99], [2, 0, 0, 99, 99], [0, 4, 8, 99, 99]] + \
        [[99] * 5] * 5
    assert padded.sample_rows.tolist() == [0, 1, 2]
    with pytest.raises(AssertionError):  # prompt tokens never take the graph path
        StepInputs.build([[5, 6]], [[0]], [2], BLOCK).padded(4, 5, 99, BLOCK)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs")
    make_checkpoint(path, num_attention_heads=8, num_key_value_heads=2)
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=40, block_size=BLOCK))


def test_padded_decode_gives_the_real_rows_the_same_logits_and_leaves_their_cache_alone(engine):
    """What a replayed graph computes, run eagerly on CPU: the padded batch changes nothing real."""
    config = engine.config
    cache = KVCache(config, 40, BLOCK, torch.float32, engine.device, spare_block=True)
    runner = ModelRunner(engine.model, cache, engine.device)
    gen = torch.Generator().manual_seed(0)
    for k, v in cache.layers:  # stale, non-zero data everywhere, as in a cache in use
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    tables = [[3, 1, 7], [2], [0, 4, 8, 9], [11, 12]]
    contexts = [10, 3, 14, 5]
    host = StepInputs.build([[17], [23], [5], [300]], tables, contexts, BLOCK)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    with torch.inference_mode():
        eager = engine.model.compute_logits(runner.forward(host))
        eager_cache = [(k.clone(), v.clone()) for k, v in cache.layers]
        for (k, v), (k0, v0) in zip(cache.layers, before):
            k.copy_(k0)
            v.copy_(v0)
        padded = host.padded(8, 10, cache.pad_block, BLOCK)
        meta = AttentionMetadata.from_inputs(padded, padded, BLOCK, runner.attention)
        hidden = engine.model(padded.input_ids, padded.positions, cache.layers, meta)
        logits = engine.model.compute_logits(hidden[padded.sample_rows])
    assert logits.shape == eager.shape
    assert (logits - eager).abs().max().item() <= 1e-5
    spare = slice(cache.pad_block * BLOCK, (cache.pad_block + 1) * BLOCK)
    for (k, v), (ek, ev) in zip(cache.layers, eager_cache):
        outside = torch.ones(k.shape[1], dtype=torch.bool)
        outside[spare] = False
        assert torch.equal(k[:, outside], ek[:, outside]) and torch.equal(v[:, outside], ev[:, outside])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_replayed_graphs_generate_what_eager_steps_do(tmp_path):
    """float32: a padded batch changes a row's matmul only in rounding order, far below a greedy margin."""
    make_checkpoint(tmp_path, num_attention_heads=8, num_key_value_heads=2)
    prompts = [[(7 * i + j) % 500 for j in range(3 + 5 * i)] for i in range(11)]  # 11: a padded bucket (16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for eager in (True, False):
        engine = LLMEngine(tmp_path, EngineConfig(device="cuda", dtype="float32", num_blocks=256, block_size=16,
                                                  enforce_eager=eager, max_model_len=256))
        assert (engine.runner.graphs is None) == eager
        results[eager] = engine.generate(prompts, params)
    assert results[False] == results[True]
