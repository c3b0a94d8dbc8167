"""The default dtype on CPU, bfloat16, against transformers' Qwen3 in bfloat16 on the same random checkpoint.

bf16 keeps 8 significant bits, so two correct implementations that round in a different order
disagree in the last bits of every activation, and the difference grows through the layers. The
tolerance is therefore measured, not guessed: transformers' own bf16 logits are compared with
its float32 logits, and ours may be no farther from transformers' bf16 than twice that distance
(two implementations, each that far from exact). Greedy tokens must agree wherever the
reference's best two logits are further apart than twice its own rounding error on that step:
closer than that, the two may rank them either way (a near-tie).
"""
import copy

import pytest
import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.unit.test_engine_reference import forward, random_prompt

STEPS = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bf16")
    reference = make_checkpoint(path, eos_token_id=(), num_hidden_layers=4)
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64, block_size=8))
    return reference, copy.deepcopy(reference).to(torch.bfloat16), engine


def logits_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_engine_serves_bfloat16(models):
    _, _, engine = models
    assert engine.dtype == torch.bfloat16


def test_bf16_logits_match_transformers_bf16_within_its_own_rounding(models):
    fp32, bf16, engine = models
    prompt = random_prompt(40, seed=5)
    want = logits_of(bf16, prompt)
    rounding = (want - logits_of(fp32, prompt)).abs().max().item()
    (ours,) = forward(engine, [prompt])
    diff = (ours.float() - want).abs().max().item()
    assert 0 < rounding < 0.1 * want.abs().max().item()  # the measure itself is sane: bf16 is inexact, not broken
    assert diff <= 2 * rounding, (diff, rounding)


def test_bf16_greedy_agrees_with_transformers_bf16_except_at_near_ties(models):
    fp32, bf16, engine = models
    prompt = random_prompt(9, seed=6)
    (ours,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    # The reference's logits for every step of our continuation, in one forward (teacher forcing).
    want = logits_of(bf16, prompt + ours)[len(prompt) - 1:-1]
    rounding = (want - logits_of(fp32, prompt + ours)[len(prompt) - 1:-1]).abs().max(dim=-1).values
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * rounding
    assert clear.sum().item() >= STEPS // 2  # most steps are decided, or this test would check nothing
    agree = torch.tensor(ours) == want.argmax(dim=-1)
    assert agree[clear].all(), [i for i in range(STEPS) if clear[i] and not agree[i]]
    assert len(set(ours)) > 3
