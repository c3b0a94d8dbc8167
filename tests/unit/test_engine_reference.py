"""The hand-built Qwen3 engine against transformers' Qwen3 on the same random checkpoints, in float32."""
import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.engine.sequence import Sequence
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from tests.checkpoints import make_checkpoint

SHAPES = {
    "tiny": {},
    "head_dim_not_hidden_over_heads": dict(hidden_size=64, num_attention_heads=4, head_dim=32),
    "gqa_1": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    "untied": dict(tie_word_embeddings=False),
    "sharded": dict(max_shard_size="100KB", tie_word_embeddings=False),
    "rope_theta_top_level": dict(rope_spelling="rope_theta", rope_theta=1_000_000.0),
    "attention_bias": dict(attention_bias=True),
    "yarn": dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn_top_level": dict(rope_spelling="rope_theta",
                           rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = make_checkpoint(path, **SHAPES[request.param])
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=96, block_size=8))
    return reference, engine


def forward(engine: LLMEngine, prompts: list[list[int]], cached: list[int] | None = None,
            slots: list[int] | None = None) -> list[torch.Tensor]:
    """Logits for every new token of each prompt, in one flat batched forward.

    cached[i] tokens of prompt i are taken as already in the KV cache, written by an earlier
    call with the same slots[i] (which picks the prompt's region of the block pool).
    """
    cached = cached or [0] * len(prompts)
    slots = slots or list(range(len(prompts)))
    seqs, ids, positions = [], [], []
    for slot, prompt, done in zip(slots, prompts, cached):
        seq = Sequence(f"s{slot}", prompt, SamplingParams(), 1, frozenset())
        seq.block_table = list(range(slot * 12, slot * 12 + engine.block_manager.blocks_needed(len(prompt))))
        seqs.append(seq)
        ids += prompt[done:]
        positions += range(done, len(prompt))
    meta = AttentionMetadata.build([s.block_table for s in seqs], [len(p) for p in prompts],
                                   [len(p) - c for p, c in zip(prompts, cached)], engine.kv_cache.block_size,
                                   engine.device)
    with torch.inference_mode():
        hidden = engine.model(torch.tensor(ids), torch.tensor(positions), engine.kv_cache.layers, meta)
        logits = engine.model.compute_logits(hidden)
    return list(logits.split([len(p) - c for p, c in zip(prompts, cached)]))


def reference_logits(reference, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0]


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_match_reference(pair):
    reference, engine = pair
    prompt = random_prompt(37, seed=1)
    (ours,) = forward(engine, [prompt])
    assert (ours - reference_logits(reference, prompt)).abs().max().item() <= 1e-4


def test_greedy_continuation_matches_generate(pair):
    reference, engine = pair
    prompt = random_prompt(11, seed=2)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    (ours,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert ours == expected
    assert len(set(expected)) > 3  # a degenerate model would make this test meaningless


def test_batched_sequences_match_each_alone(pair):
    _, engine = pair
    prompts = [random_prompt(n, seed=10 + n) for n in (5, 23, 1, 40)]
    together = forward(engine, prompts)
    for prompt, batched in zip(prompts, together):
        (alone,) = forward(engine, [prompt])
        assert (batched - alone).abs().max().item() <= 1e-4


def test_incremental_decode_matches_full_forward(pair):
    reference, engine = pair
    prompts = [random_prompt(n, seed=20 + n) for n in (9, 30)]
    forward(engine, [p[:5] for p in prompts])            # prefill a prefix
    forward(engine, [p[:17] for p in prompts], [5, 5])    # a cached chunk of several tokens
    steps = []
    for length in range(18, 31):                          # then one token at a time
        live = [i for i, p in enumerate(prompts) if len(p) >= length]
        steps.append(forward(engine, [prompts[i][:length] for i in live], [length - 1] * len(live), live))
    full = [reference_logits(reference, p) for p in prompts]
    last_of_long = torch.stack([s[-1][-1] for s in steps])
    assert (last_of_long - full[1][17:30]).abs().max().item() <= 1e-4


def test_several_sequences_generate_like_alone(pair):
    _, engine = pair
    prompts = [random_prompt(n, seed=30 + n) for n in (3, 17, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert together == alone
    assert engine.block_manager.num_used == 0
