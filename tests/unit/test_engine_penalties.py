"""Penalties through the engine's step, against transformers' generate and hand-computed logits (float32)."""
import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.penalties import penalised_greedy
from tests.unit.test_engine_reference import random_prompt

STEPS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-penalties")
    reference = make_checkpoint(path, eos_token_id=())
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=64, block_size=8))
    return reference, engine


def greedy(**penalties) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, **penalties)


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_equals_generate(pair, penalty):
    reference, engine = pair
    prompt = random_prompt(12, seed=3)
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False,
                                  repetition_penalty=penalty, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    (ours,) = engine.generate([prompt], greedy(repetition_penalty=penalty))
    assert ours == want
    # The penalty must change the output, or this test would not see it being skipped.
    assert ours != engine.generate([prompt], greedy())[0]


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.0), (0.6, 0.8)])
def test_presence_and_frequency_penalties_equal_hand_computed_logits(pair, presence, frequency):
    reference, engine = pair
    prompt = random_prompt(10, seed=4) * 2  # repeated prompt tokens: counting them would show
    want = penalised_greedy(reference, prompt, STEPS, presence, frequency)
    (ours,) = engine.generate([prompt], greedy(presence_penalty=presence, frequency_penalty=frequency))
    assert ours == want
    assert ours != engine.generate([prompt], greedy())[0]
    # Prompt tokens do not count: a history mix-up (prompt counted as output) gives other tokens here.
    assert ours != penalised_greedy(reference, prompt, STEPS, presence, frequency, count_prompt=True)


def test_penalised_and_plain_sequences_batched_together_keep_their_own_histories(pair):
    _, engine = pair
    prompts = [random_prompt(n, seed=40 + n) for n in (7, 15, 3)]
    params = [greedy(presence_penalty=1.0, frequency_penalty=0.5), greedy(), greedy(repetition_penalty=1.4)]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], q)[0] for p, q in zip(prompts, params)]
    assert together == alone
