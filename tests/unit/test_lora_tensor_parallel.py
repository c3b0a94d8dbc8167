"""LoRA adapters on two CPU ranks (gloo): column-parallel layers split B by output, row-parallel ones A by input;
the tokens of one rank and of transformers + peft, adapters loaded at start and at run time, a mixed batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.checkpoints import make_checkpoint
from tests.lora_adapters import greedy_reference, make_adapter
from tests.lora_tp_probe import LENGTH, MIXED, PROMPTS, probe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADAPTERS = {
    "a": dict(rank=8, seed=1),  # every target module
    "b": dict(rank=16, seed=2, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"], use_rslora=True,
              lora_alpha=8),
    "c": dict(rank=4, seed=3, target_modules=["k_proj", "gate_proj", "down_proj"], std=0.3),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-tp-base")
    references = {"": make_checkpoint(path, eos_token_id=())}
    folders = {}
    for name, kwargs in ADAPTERS.items():
        folders[name] = str(tmp_path_factory.mktemp(f"lora-tp-{name}"))
        references[name] = make_adapter(path, folders[name], **kwargs)
    out = path / "tp2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-m", "tests.lora_tp_probe", str(path), "2", str(out), *folders.values()],
                   cwd=ROOT, env=env, check=True, timeout=180)
    two = json.loads(out.read_text())
    return references, probe(str(path), 1, folders), two


def test_two_ranks_decode_each_adapter_like_peft(runs):
    references, _, two = runs
    for adapter, tokens in two["alone"].items():
        assert tokens == greedy_reference(references[adapter], PROMPTS[0], LENGTH), adapter
    # Else the comparison could pass with LoRA never applied on some rank.
    assert len({tuple(t) for t in two["alone"].values()}) == len(two["alone"])


def test_a_mixed_batch_on_two_ranks_matches_peft_and_one_rank(runs):
    references, one, two = runs
    assert two["mixed"] == one["mixed"]
    for (prompt, adapter), tokens in zip(MIXED, two["mixed"]):
        assert tokens == greedy_reference(references[adapter], PROMPTS[prompt], LENGTH), (prompt, adapter)


def test_adapters_loaded_and_unloaded_at_run_time_reach_both_ranks(runs):
    references, one, two = runs
    assert two["after_reload"] == one["after_reload"]
    for adapter, tokens in zip(("b", "c", ""), two["after_reload"]):
        assert tokens == greedy_reference(references[adapter], PROMPTS[1], LENGTH), adapter
