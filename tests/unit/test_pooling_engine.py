"""Prompt-only (pooling) requests in the engine against transformers' Qwen3 on the same random checkpoint, in float32:
an embedding is the last token's final hidden state (after the model's norm), normalised; a score is the raw logits
of given ids at the last position. Alone, batched, beside generating sequences, over prefix hits and chunked prefill."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from rpcserver.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.engine.pooling import PoolingParams
from tests.checkpoints import TINY, make_checkpoint
from tests.lora_adapters import make_adapter
from tests.pooling_tp_probe import YES_NO as PROBE_YES_NO
from tests.unit.test_batching import greedy

VOCAB, HIDDEN = TINY["vocab_size"], TINY["hidden_size"]
YES_NO = (17, 301)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pooling")
    return make_checkpoint(path, eos_token_id=()), path


def make_engine(path, max_num_batched_tokens: int = 512, max_num_seqs: int = 16, device: str = "cpu",
                **config) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device=device, dtype="float32", num_blocks=256, block_size=4,
                                        limits=SchedulerLimits(max_num_seqs, max_num_batched_tokens), **config))


def prompts(seed: int, count: int, low: int = 1, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(low, high))] for _ in range(count)]


@torch.no_grad()
def reference_hidden(reference, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden state (after the model's norm) at the last position."""
    return reference.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]


@torch.no_grad()
def reference_logits(reference, prompt: list[int]) -> torch.Tensor:
    return reference(input_ids=torch.tensor([prompt])).logits[0, -1]


def assert_embeds(reference, prompt: list[int], values: list[float], dimensions: int | None = None) -> None:
    want = reference_hidden(reference, prompt)
    want = F.normalize(want if dimensions is None else want[:dimensions], dim=0)
    got = torch.tensor(values)
    assert got.shape == want.shape
    assert abs(got.norm().item() - 1.0) < 1e-5
    assert F.cosine_similarity(got, want, dim=0).item() >= 0.99999


def assert_scores(reference, prompt: list[int], values: list[float], token_ids=YES_NO) -> None:
    want = reference_logits(reference, prompt)[list(token_ids)]
    got = torch.tensor(values)
    assert (got - want).abs().max().item() <= 1e-4
    assert abs(torch.sigmoid(got[0] - got[1]).item() - torch.sigmoid(want[0] - want[1]).item()) <= 1e-5


def test_embeddings_match_reference_alone_and_batched(pair):
    reference, path = pair
    engine = make_engine(path)
    batch = prompts(1, 12)
    for prompt in batch[:4]:
        (values,) = engine.pool([prompt], PoolingParams.embed())
        assert_embeds(reference, prompt, values)
    for prompt, values in zip(batch, engine.pool(batch, PoolingParams.embed())):
        assert_embeds(reference, prompt, values)
    for prompt, values in zip(batch, engine.pool(batch, PoolingParams.embed(dimensions=16))):
        assert len(values) == 16
        assert_embeds(reference, prompt, values, dimensions=16)
    assert engine.block_manager.num_used == 0 and not engine.has_work()


def test_scores_match_reference_and_share_steps_with_embeddings(pair):
    reference, path = pair
    engine = make_engine(path)
    batch = prompts(2, 8)
    for i, prompt in enumerate(batch):
        if i % 2:
            engine.add_pooling_request(f"s{i}", prompt, PoolingParams.score(YES_NO))
        else:
            engine.add_pooling_request(f"e{i}", prompt, PoolingParams.embed(dimensions=HIDDEN))
    outputs = {}
    while engine.has_work():
        engine.step()
        outputs.update((o.request_id, o) for o in engine.take_pooled())
    for i, prompt in enumerate(batch):
        output = outputs[f"s{i}" if i % 2 else f"e{i}"]
        assert output.prompt_tokens == len(prompt)
        if i % 2:
            assert_scores(reference, prompt, output.values)
        else:
            assert_embeds(reference, prompt, output.values)
    # A single id, and ids in any order and repeated, each at its place.
    (one,), (many,) = engine.pool([batch[0]], PoolingParams.score([5])), engine.pool(
        [batch[0]], PoolingParams.score([301, 5, 301]))
    logits = reference_logits(reference, batch[0])
    assert torch.allclose(torch.tensor(one), logits[[5]], atol=1e-4)
    assert torch.allclose(torch.tensor(many), logits[[301, 5, 301]], atol=1e-4)


@pytest.mark.parametrize("device, async_scheduling", [
    ("cpu", False), ("cpu", True), pytest.param("cuda", None, marks=pytest.mark.cuda)])
def test_pooling_shares_steps_with_generating_sequences(pair, device, async_scheduling):
    """Generating sequences decode while pooling requests join and leave: both get what they get alone. On a GPU
    (asynchronous scheduling, decode steps replayed from CUDA graphs) as on a CPU."""
    reference, path = pair
    generating = prompts(3, 4, 3, 20)
    alone = make_engine(path, device=device).generate(generating, greedy(16))
    engine = make_engine(path, device=device, async_scheduling=async_scheduling)
    for i, prompt in enumerate(generating):
        engine.add_request(f"g{i}", prompt, greedy(16))
    tokens = {f"g{i}": [] for i in range(len(generating))}
    for out in engine.step() + engine.step():
        tokens[out.request_id].append(out.token_id)
    pooling = prompts(4, 6)
    pooled, shared_steps = {}, 0
    added = 0
    while engine.has_work():
        if added < len(pooling):  # one joins every step, so they meet sequences at every stage
            kind = PoolingParams.score(YES_NO) if added % 3 == 2 else PoolingParams.embed()
            engine.add_pooling_request(f"p{added}", pooling[added], kind)
            added += 1
        step = engine.step()
        for out in step:
            tokens[out.request_id].append(out.token_id)
        taken = engine.take_pooled()
        shared_steps += bool(step and taken)
        pooled.update((o.request_id, o.values) for o in taken)
    assert [tokens[f"g{i}"] for i in range(len(generating))] == alone
    assert shared_steps >= 3
    for i, prompt in enumerate(pooling):
        if i % 3 == 2:
            assert_scores(reference, prompt, pooled[f"p{i}"])
        else:
            assert_embeds(reference, prompt, pooled[f"p{i}"])
    assert engine.block_manager.num_used == 0


def test_prefix_cache_hit(pair):
    """A reused prefix: only the last block is computed, and the embedding is the same. 17 tokens over blocks of 4
    leave one token to compute, beside decoding sequences: a step of one-token rows that is not a decode step."""
    reference, path = pair
    engine = make_engine(path)
    prompt = prompts(5, 1, 17, 18)[0]
    (cold,) = engine.pool([prompt], PoolingParams.embed())
    hits = engine.block_manager.prefix_hits
    engine.add_request("g", prompts(6, 1, 5, 6)[0], greedy(8))
    engine.step()
    engine.add_pooling_request("warm", prompt, PoolingParams.embed())
    engine.add_pooling_request("warm-score", prompt, PoolingParams.score(YES_NO))
    pooled = {}
    while engine.has_work():
        engine.step()
        pooled.update((o.request_id, o.values) for o in engine.take_pooled())
    assert engine.block_manager.prefix_hits - hits == 2 * 16
    assert_embeds(reference, prompt, cold)
    assert_embeds(reference, prompt, pooled["warm"])
    assert_scores(reference, prompt, pooled["warm-score"])


def test_chunked_prefill(pair):
    """Prompts longer than a step's token budget are prefilled in chunks; only the last chunk pools."""
    reference, path = pair
    engine = make_engine(path, max_num_batched_tokens=32, max_num_seqs=8)
    batch = prompts(7, 3, 70, 140)
    engine.add_request("g", [1, 2, 3], greedy(40))
    for prompt, values in zip(batch, engine.pool(batch, PoolingParams.embed())):
        assert_embeds(reference, prompt, values)
    (scores,) = engine.pool(batch[:1], PoolingParams.score(YES_NO))
    assert_scores(reference, batch[0], scores)


def test_whole_context_prompt(pair):
    """Nothing is generated after a pooled prompt: it may fill the context, which a generating one may not."""
    reference, path = pair
    engine = make_engine(path)
    prompt = prompts(8, 1, TINY["max_position_embeddings"], TINY["max_position_embeddings"] + 1)[0]
    assert len(prompt) == engine.max_model_len
    (values,) = engine.pool([prompt], PoolingParams.embed())
    assert_embeds(reference, prompt, values)


def test_speculative_engine(pair):
    """With speculation on (a draft model: the checkpoint itself, proposing every step), pooled prompts get no
    proposals and share the verification steps; the generated ids stay those of plain greedy decoding."""
    reference, path = pair
    engine = make_engine(path, speculative=SpeculativeConfig("draft", draft_model=str(path), num_speculative_tokens=3,
                                                             fixed_k=True))
    engine.add_request("g", [5, 6, 5, 6, 5, 6, 5], greedy(30))
    generated = [out.token_id for out in engine.step()]
    batch = prompts(9, 4)
    for i, prompt in enumerate(batch):
        engine.add_pooling_request(f"p{i}", prompt, PoolingParams.embed())
    pooled, proposed = {}, engine.stats()["spec_proposed"]
    while len(pooled) < len(batch):
        generated += [out.token_id for out in engine.step()]
        pooled.update((o.request_id, o.values) for o in engine.take_pooled())
    assert engine.stats()["spec_proposed"] > proposed
    while engine.has_work():
        generated += [out.token_id for out in engine.step()]
    for i, prompt in enumerate(batch):
        assert_embeds(reference, prompt, pooled[f"p{i}"])
    assert generated == make_engine(path).generate([[5, 6, 5, 6, 5, 6, 5]], greedy(30))[0]


def test_abort_frees_a_pooling_request(pair):
    _, path = pair
    engine = make_engine(path, max_num_batched_tokens=32, max_num_seqs=8)
    engine.add_pooling_request("long", prompts(10, 1, 200, 201)[0], PoolingParams.embed())
    engine.step()
    assert engine.block_manager.num_used > 0
    assert engine.abort("long")
    assert not engine.has_work() and engine.block_manager.num_used == 0 and engine.scheduler.num_pooling == 0
    assert engine.take_pooled() == []


def test_bare_decoder_checkpoint(pair, tmp_path):
    """Published Qwen3-Embedding checkpoints hold the bare decoder (Qwen3Model: no "model." prefix, no head) under
    a Qwen3ForCausalLM config: they load, and embed as the same weights saved whole do."""
    reference, path = pair
    reference.model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    (tmp_path / "generation_config.json").write_text((path / "generation_config.json").read_text())
    batch = prompts(13, 3)
    for prompt, values in zip(batch, make_engine(tmp_path).pool(batch, PoolingParams.embed())):
        assert_embeds(reference, prompt, values)


def test_bare_decoder_without_head(tmp_path):
    """Qwen3-Embedding-4B and -8B: a bare decoder under a config that does not tie a head, and no head saved. It
    loads with the head tied to the embedding and embeds as transformers does; generating
    and scoring, which need the head it lacks, are refused."""
    whole = tmp_path / "whole"
    reference = make_checkpoint(whole, seed=3, eos_token_id=(), tie_word_embeddings=False)
    bare = tmp_path / "bare"
    reference.model.save_pretrained(bare)
    config = json.loads((bare / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    (bare / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    engine = make_engine(bare)
    assert not engine.model.has_lm_head and engine.has_lm_head is False
    batch = prompts(17, 4)
    for prompt, values in zip(batch, engine.pool(batch, PoolingParams.embed())):
        assert_embeds(reference, prompt, values)
    with pytest.raises(FailedPrecondition, match="no lm_head"):
        engine.add_request("g", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(FailedPrecondition, match="no lm_head"):
        engine.add_pooling_request("s", [1, 2, 3], PoolingParams.score(YES_NO))
    assert not engine.has_work()
    # The same weights saved whole keep their own head, and generate.
    whole_engine = make_engine(whole)
    assert whole_engine.has_lm_head
    assert_scores(reference, batch[0], whole_engine.pool(batch[:1], PoolingParams.score(YES_NO))[0])


def test_runner_leaves_out_a_kind(pair):
    """--runner pooling serves Embed and Score and refuses generation; --runner generate the reverse."""
    reference, path = pair
    pooling = make_engine(path, runner="pooling")
    batch = prompts(19, 2)
    for prompt, values in zip(batch, pooling.pool(batch, PoolingParams.embed())):
        assert_embeds(reference, prompt, values)
    assert_scores(reference, batch[0], pooling.pool(batch[:1], PoolingParams.score(YES_NO))[0])
    with pytest.raises(FailedPrecondition, match="--runner pooling"):
        pooling.add_request("g", [1, 2, 3], SamplingParams(max_tokens=2))
    generate = make_engine(path, runner="generate")
    with pytest.raises(FailedPrecondition, match="--runner generate"):
        generate.add_pooling_request("e", [1, 2, 3], PoolingParams.embed())
    assert generate.generate([[1, 2, 3]], greedy(4)) == make_engine(path).generate([[1, 2, 3]], greedy(4))
    with pytest.raises(ValueError, match="runner must be one of auto, generate, pooling"):
        make_engine(path, runner="embed")


def test_lora_adapter(pair, tmp_path):
    """A pooling request may name a LoRA adapter: its embedding and scores are the adapted model's (peft's), in
    the same steps as the base model's."""
    reference, path = pair
    adapted = make_adapter(path, tmp_path / "a", rank=4, std=0.3).base_model.model
    engine = make_engine(path, enable_lora=True, max_loras=2, max_lora_rank=8,
                         lora_modules=(("a", str(tmp_path / "a")),))
    batch = prompts(14, 4)
    for i, prompt in enumerate(batch):
        for adapter in ("", "a"):
            engine.add_pooling_request(f"e{i}{adapter}", prompt, PoolingParams.embed(), adapter)
            engine.add_pooling_request(f"s{i}{adapter}", prompt, PoolingParams.score(YES_NO), adapter)
    pooled = {}
    while engine.has_work():
        engine.step()
        pooled.update((o.request_id, o.values) for o in engine.take_pooled())
    for i, prompt in enumerate(batch):
        for adapter, model in (("", reference), ("a", adapted)):
            assert_embeds(model, prompt, pooled[f"e{i}{adapter}"])
            assert_scores(model, prompt, pooled[f"s{i}{adapter}"])
    assert pooled["e0a"] != pooled["e0"]


def test_queue_limit_counts_generating_requests_only(pair):
    """A pooling call's inputs come to the core together, the worker counting the call as one request: the
    core's queue limit refuses none of them, nor counts them against a generating request."""
    _, path = pair
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=256, block_size=4,
                                          limits=SchedulerLimits(8, 64, max_waiting=2)))
    for i, prompt in enumerate(prompts(12, 6)):
        engine.add_pooling_request(f"p{i}", prompt, PoolingParams.embed())
    engine.add_request("g0", [1, 2, 3], greedy(4))
    engine.add_request("g1", [1, 2, 3], greedy(4))
    with pytest.raises(ResourceExhausted):
        engine.add_request("g2", [1, 2, 3], greedy(4))


@pytest.mark.parametrize("prompt, pooling, message", [
    ([], PoolingParams.embed(), "empty"),
    ([1, VOCAB], PoolingParams.embed(), "outside the vocabulary"),
    ([1] * (TINY["max_position_embeddings"] + 1), PoolingParams.embed(), "context"),
    ([1, 2], PoolingParams.embed(dimensions=0), "dimensions"),
    ([1, 2], PoolingParams.embed(dimensions=HIDDEN + 1), "dimensions"),
    ([1, 2], PoolingParams.score([]), "token_ids is empty"),
    ([1, 2], PoolingParams.score([3, VOCAB]), "outside the vocabulary"),
])
def test_refusals(pair, prompt, pooling, message):
    _, path = pair
    engine = make_engine(path)
    with pytest.raises(InvalidArgument, match=message):
        engine.add_pooling_request("r", prompt, pooling)
    assert not engine.has_work()


def test_two_tensor_parallel_ranks(pair, tmp_path):
    """Rank 0 tells the other ranks how many rows want hidden states: they project the rest, as it does."""
    reference, path = pair
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "tp2.json"
    subprocess.run([sys.executable, "-m", "tests.pooling_tp_probe", str(path), "2", str(out)], cwd=root, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}, timeout=180)
    result = json.loads(out.read_text())
    for i, prompt in enumerate(result["prompts"]):
        assert_embeds(reference, prompt, result["values"][f"e{i}"])
        assert_scores(reference, prompt, result["values"][f"s{i}"], PROBE_YES_NO)
    assert result["generated"] == make_engine(path).generate([[3, 1, 4, 1, 5]], greedy(24))[0]
