"""How far an 8-bit KV cache moves the model: the mean KL divergence of next-token distributions of fp8 and int8
caches from the bf16 cache's, over prompts and the decode steps after them (which read the cache), on a random
Qwen3 checkpoint served in bf16. Bound: 0.01 nats.

The divergence grows with how sharply the model's logits respond to its hidden states, which a random checkpoint
sets through its initialiser's spread: with this checkpoint (0.05) fp8 measured about 0.0011 and int8 0.00012;
at 0.1 (flatter-than-real distributions still, entropy 4.9 nats) fp8 measured 0.0101 and int8 0.0011
(docs/kv-cache.md). The test also bounds the entropy, so that it measures distributions neither one-hot nor
uniform."""
import math

import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.unit.test_engine_reference import forward, random_prompt

PROMPT_LENGTHS = (12, 29, 40, 57, 64, 80)
DECODE_STEPS = 16
BOUND = 0.01


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv8-fidelity")
    # The 0.6B model's head size and GQA ratio.
    make_checkpoint(path, eos_token_id=(), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=128, initializer_range=0.05)
    return path


def engine_for(path, kind: str) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=96, block_size=8,
                                        kv_cache_dtype=kind))


def next_token_logits(engine: LLMEngine, sequences: list[list[int]], prompt_lens: list[int]) -> torch.Tensor:
    """Each sequence's prompt prefilled, then its continuation teacher-forced one decode step at a time (every
    sequence in one step): the logits after each prompt and after each decoded token, (rows, vocab) float32."""
    rows = [logits[-1] for logits in forward(engine, [s[:n] for s, n in zip(sequences, prompt_lens)])]
    for step in range(DECODE_STEPS):
        lengths = [n + step + 1 for n in prompt_lens]
        rows += [logits[-1] for logits in forward(engine, [s[:n] for s, n in zip(sequences, lengths)],
                                                  cached=[n - 1 for n in lengths])]
    return torch.stack(rows).float()


def test_8bit_caches_stay_within_kl_bound_of_bf16(checkpoint):
    reference = engine_for(checkpoint, "auto")
    prompts = [random_prompt(n, seed=n) for n in PROMPT_LENGTHS]
    continuations = reference.generate(prompts, SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS,
                                                               ignore_eos=True))
    sequences = [p + c for p, c in zip(prompts, continuations)]
    want = next_token_logits(reference, sequences, list(PROMPT_LENGTHS)).log_softmax(-1)
    entropy = -(want.exp() * want).sum(-1).mean().item()
    assert 1.0 < entropy < math.log(want.shape[-1]) - 0.2, entropy  # neither one-hot nor uniform
    kls = {}
    for kind in ("fp8", "int8"):
        got = next_token_logits(engine_for(checkpoint, kind), sequences, list(PROMPT_LENGTHS)).log_softmax(-1)
        kl = (want.exp() * (want - got)).sum(-1)  # KL(bf16 cache || 8-bit cache) per position
        kls[kind] = kl.mean().item()
    assert all(0 < kl <= BOUND for kl in kls.values()), kls
    assert kls["int8"] < kls["fp8"], kls  # 7 bits of mantissa-equivalent per row against e4m3's 3
