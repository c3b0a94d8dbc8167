"""--kv-cache-dtype in the engine: the flag and config, the cache's storage and sizing, the checkpoint's fp8 scales,
and chunked prefill, prefix caching, the fused decode loop, speculative decoding and tensor parallelism on 8-bit
caches. (Kernels: test_kv_cache_dtype_kernels.py; fidelity against the bf16 cache: test_kv_cache_dtype_fidelity.py.)

Run as `python -m tests.unit.test_kv_cache_dtype_engine CHECKPOINT SIZE KIND OUT` it is the tensor-parallel probe:
one engine at that size, its logits and tokens written to OUT (torch.distributed starts once per process).
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig
from services.model_worker.config.model import Qwen3Config
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.executor.kv_cache import KVCache
from services.model_worker.executor.kv_sizing import blocks_from_budget
from services.model_worker.executor.step_inputs import StepInputs
from services.model_worker.kernels import cpu_decoder
from services.model_worker.main import engine_config, parse_args
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from tests.checkpoints import make_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
KINDS = ["fp8", "int8"]


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def make_engine(path, kind: str, dtype: str = "float32", budget: int = 512, prefix: bool = True, num_blocks: int = 96,
                **extra):
    return LLMEngine(path, EngineConfig(device="cpu", dtype=dtype, num_blocks=num_blocks, block_size=8,
                                        kv_cache_dtype=kind,
                                        enable_prefix_caching=prefix,
                                        limits=SchedulerLimits(max_num_seqs=16, max_num_batched_tokens=budget),
                                        **extra))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv8")
    make_checkpoint(path, eos_token_id=(), **SHAPE)
    return path


# -- flag, config, storage, sizing ----------------------------------------------------------------------------


def test_flag_reaches_the_config_and_bad_values_are_refused(capsys):
    assert engine_config(parse_args([])).kv_cache_dtype == "auto"
    assert engine_config(parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    assert engine_config(parse_args(["--kv-cache-dtype", "fp8_e4m3"])).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "fp16"])
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig.from_dict(EngineConfig(kv_cache_dtype="int8").to_dict()).kv_cache_dtype == "int8"


def config_06b() -> Qwen3Config:
    return Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def test_bytes_per_block_counts_the_elements_and_the_int8_scales():
    config, block = config_06b(), 16
    rows = 2 * 28 * 8 * block  # keys and values, every layer and KV head, each token
    assert KVCache.bytes_per_block(config, block, torch.bfloat16) == rows * 128 * 2
    assert KVCache.bytes_per_block(config, block, torch.bfloat16, "auto") == rows * 128 * 2
    assert KVCache.bytes_per_block(config, block, torch.bfloat16, "fp8") == rows * 128
    assert KVCache.bytes_per_block(config, block, torch.bfloat16, "int8") == rows * (128 + 4)
    budget = 2 << 30
    blocks = {kind: blocks_from_budget(budget, KVCache.bytes_per_block(config, block, torch.bfloat16, kind),
                                       1 << 20, block, 1 << 10) for kind in ("auto", "fp8", "int8")}
    assert blocks["fp8"] == 2 * blocks["auto"]
    assert 1.9 < blocks["int8"] / blocks["auto"] < 2  # 256 / 132 bytes a row


def test_the_cache_allocates_8bit_rows_and_their_scales():
    config = Qwen3Config(**{k: v for k, v in dict(vocab_size=512, intermediate_size=128, num_hidden_layers=3,
                                                  **SHAPE).items()})
    fp8 = KVCache(config, 5, 4, torch.bfloat16, torch.device("cpu"), spare_block=True, kv_cache_dtype="fp8",
                  fp8_scales=[(torch.tensor(0.5), torch.tensor([2.0]))] * 3)
    int8 = KVCache(config, 5, 4, torch.bfloat16, torch.device("cpu"), kv_cache_dtype="int8", huge_pages=False)
    auto = KVCache(config, 5, 4, torch.bfloat16, torch.device("cpu"))
    for cache, dtype in ((fp8, torch.float8_e4m3fn), (int8, torch.int8), (auto, torch.bfloat16)):
        assert len(cache.layers) == 3
        for layer in cache.layers:
            k, v = layer  # still unpacks as the pair
            assert k.dtype == v.dtype == dtype and k.shape[0] == 2 and k.shape[2] == 64
    assert fp8.layers[0][0].shape[1] == 6 * 4  # the spare block too
    assert fp8.layers[1].k_scale.tolist() == [0.5] and fp8.layers[1].v_scale.tolist() == [2.0]
    assert int8.layers[2].k_scale.shape == (2, 20) and int8.layers[2].k_scale.dtype == torch.float32
    assert auto.layers[0].k_scale is None and auto.layers[0].scales == {}


def test_fp8_scales_load_from_the_checkpoint_else_one(checkpoint, tmp_path):
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    for name in os.listdir(checkpoint):
        if not name.endswith(".safetensors"):
            (scaled / name).write_bytes((checkpoint / name).read_bytes())
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([0.125])
    save_file(tensors, scaled / "model.safetensors", metadata={"format": "pt"})
    engine = make_engine(scaled, "fp8")
    layers = engine.kv_cache.layers
    assert [layers[0].k_scale.item(), layers[0].v_scale.item()] == [1.0, 1.0]
    assert [layers[1].k_scale.item(), layers[1].v_scale.item()] == [0.25, 0.125]
    assert make_engine(checkpoint, "fp8").kv_cache.layers[1].k_scale.item() == 1.0
    # A checkpoint with scales still serves a model-dtype cache (they are simply not used).
    assert make_engine(scaled, "auto").generate([prompt(9, 1)], greedy(4))


# -- scheduling features on 8-bit caches --------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_and_prefix_hits_match_one_step_and_misses(checkpoint, kind):
    """A prompt attends to its own rows as stored: in one step, in 16-token chunks, or after a cached prefix,
    the same tokens."""
    long_prompts = [prompt(45, 3), prompt(38, 4)]
    whole = make_engine(checkpoint, kind, prefix=False).generate(long_prompts, greedy(12))
    chunked = make_engine(checkpoint, kind, budget=16, prefix=False).generate(long_prompts, greedy(12))
    assert chunked == whole
    cached = make_engine(checkpoint, kind)
    shared = long_prompts[0][:32]
    first = cached.generate([shared + prompt(7, 5)], greedy(12))
    hits = cached.block_manager.prefix_hits
    second = cached.generate([shared + prompt(9, 6)], greedy(12))
    assert cached.block_manager.prefix_hits > hits
    fresh = make_engine(checkpoint, kind, prefix=False)
    assert second == fresh.generate([shared + prompt(9, 6)], greedy(12))
    assert first == fresh.generate([shared + prompt(7, 5)], greedy(12))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_plain_tokens(checkpoint, kind, method):
    """The draft (here the checkpoint itself) takes the same --kv-cache-dtype as the target; greedy verification
    keeps the target's tokens either way."""
    seed = prompt(6, 7)
    plain = make_engine(checkpoint, kind)
    looped = seed + plain.generate([seed], greedy(24))[0]
    prompts = [looped, prompt(9, 8), prompt(14, 9)]
    want = make_engine(checkpoint, kind).generate(prompts, greedy(16))
    spec = make_engine(checkpoint, kind, speculative=SpeculativeConfig(
        method, num_speculative_tokens=3, ngram_min=1, draft_model=str(checkpoint) if method == "draft" else None))
    assert spec.generate(prompts, greedy(16)) == want
    # Verified proposals: steps of several new tokens a sequence, over its cached 8-bit rows.
    assert spec.speculator.num_proposed > 0
    if method == "draft":  # the target itself drafting: most proposals stand
        assert spec.speculator.num_accepted > spec.speculator.num_proposed // 2
    if method == "draft":
        assert spec.draft_executor.kv_cache.dtype == plain.kv_cache.dtype


@pytest.mark.parametrize("kind", KINDS)
def test_sixteen_sequence_decode_runs_the_fused_loop_with_its_layer_by_layer_bits(checkpoint, kind, monkeypatch):
    engine = make_engine(checkpoint, kind, dtype="bfloat16", num_blocks=160)
    fused = engine.model.model.fused_decode
    if fused is None:
        pytest.skip("no fused decode loop on this CPU (it needs AVX512-BF16)")
    calls = []
    real = cpu_decoder.decode_layers
    monkeypatch.setattr(cpu_decoder, "decode_layers", lambda *a: calls.append(1) or real(*a))
    lengths = [10 + 4 * i for i in range(16)]
    tables = [list(range(9 * i, 9 * i + 9)) for i in range(16)]
    prompts = [prompt(n, 20 + i) for i, n in enumerate(lengths)]
    with torch.inference_mode():
        engine.runner.forward(StepInputs.build(prompts, tables, lengths, 8))  # prefill writes the caches
        caches = [tuple(t.clone() for t in (*layer, layer.k_scale, layer.v_scale)) for layer in engine.kv_cache.layers]
        ids, positions = torch.tensor(prompt(16, 50)), torch.tensor(lengths)
        meta = AttentionMetadata.build(tables, [n + 1 for n in lengths], [1] * 16, 8, engine.device,
                                       engine.runner.attention)
        hidden_in = engine.model.model.embed_tokens(ids)
        assert fused.takes(hidden_in, meta)
        fused_out = engine.model(ids, positions, engine.kv_cache.layers, meta)
        assert calls == [1]
        written = [tuple(t.clone() for t in (*layer, layer.k_scale, layer.v_scale)) for layer in engine.kv_cache.layers]
        for layer, saved in zip(engine.kv_cache.layers, caches):  # back to before the step, then layer by layer
            for t, s in zip((*layer, layer.k_scale, layer.v_scale), saved):
                t.copy_(s)
        engine.model.model.fused_decode = None
        plain_out = engine.model(ids, positions, engine.kv_cache.layers, meta)
        engine.model.model.fused_decode = fused
    assert calls == [1]
    assert torch.equal(fused_out, plain_out)
    for layer, want in zip(engine.kv_cache.layers, written):
        for t, w in zip((*layer, layer.k_scale, layer.v_scale), want):
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               w.view(torch.uint8) if w.element_size() == 1 else w)


# -- tensor parallelism -------------------------------------------------------------------------------------------


def probe(checkpoint: str, size: int, kind: str) -> dict:
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=96, block_size=8, tensor_parallel_size=size, kv_cache_dtype=kind,
        limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=16)))
    try:
        first = prompt(37, 1)
        host = StepInputs.build([first], [list(range(5))], [37], 8)
        host.sample_rows = torch.arange(37)
        with torch.inference_mode():
            logits = engine.model.compute_logits(engine.runner.forward(host))
        return {"logits": logits.tolist(), "dtype": str(engine.kv_cache.dtype),
                "batched": engine.generate([prompt(n, 30 + n) for n in (3, 17, 40)], greedy(12))}
    finally:
        engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_give_the_logits_and_tokens_of_one(checkpoint, kind, tmp_path):
    """Each rank holds its own KV heads and, for int8, their scales: the same arithmetic as one rank."""
    out = tmp_path / "tp2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-m", "tests.unit.test_kv_cache_dtype_engine", str(checkpoint), "2", kind,
                    str(out)], cwd=ROOT, env=env, check=True, timeout=300)
    two = json.loads(out.read_text())
    one = probe(str(checkpoint), 1, kind)
    assert two["dtype"] == one["dtype"] == str({"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kind])
    assert (torch.tensor(two["logits"]) - torch.tensor(one["logits"])).abs().max().item() <= 1e-3
    assert two["batched"] == one["batched"]


if __name__ == "__main__":
    checkpoint_dir, tp_size, cache_kind, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with open(out_path, "w") as f:
        json.dump(probe(checkpoint_dir, tp_size, cache_kind), f)
