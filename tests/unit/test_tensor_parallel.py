"""Tensor parallelism on CPU ranks (gloo): the same logits and tokens as one rank, a rank's share of the weights, refusals."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import ConfigError, Qwen3Config
from services.model_worker.distributed.parallel import TensorParallel, check_divisible
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.model.loader import load_model
from tests.checkpoints import make_checkpoint
from tests.tp_probe import probe, prompt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {
    "tied": {},
    "gqa_1": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    # Untied too: the head's own weight split by vocabulary rows (a shape of its own added only the time of a run).
    "attention_bias": dict(attention_bias=True, tie_word_embeddings=False),
}


def run_probe(checkpoint, size: int, out_path) -> dict:
    """The probe in a process of its own: it is rank 0 and starts the other ranks itself."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    subprocess.run([sys.executable, "-m", "tests.tp_probe", str(checkpoint), str(size), str(out_path)], cwd=ROOT,
                   env=env, check=True, timeout=180)
    with open(out_path) as f:
        return json.load(f)


@pytest.fixture(scope="module", params=list(SHAPES))
def runs(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    reference = make_checkpoint(path, **SHAPES[request.param])
    return reference, probe(str(path), 1), run_probe(path, 2, path / "tp2.json")


def test_two_ranks_give_the_logits_of_one(runs):
    reference, one, two = runs
    with torch.no_grad():
        want = reference(torch.tensor([prompt(37, 1, 512)])).logits[0]
    assert (torch.tensor(two["logits"]) - torch.tensor(one["logits"])).abs().max().item() <= 1e-3
    assert (torch.tensor(two["logits"]) - want).abs().max().item() <= 1e-3


def test_two_ranks_decode_greedily_like_transformers(runs):
    reference, _, two = runs
    first = prompt(11, 2, 512)
    with torch.no_grad():
        want = reference.generate(torch.tensor([first]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(first):].tolist()
    assert two["greedy"] == want
    assert len(set(want)) > 3  # a degenerate model would make this test meaningless


def test_batched_chunked_and_prefix_hit_runs_match_one_rank(runs):
    _, one, two = runs
    for key in ("batched", "chunked", "prefix_hit"):
        assert two[key] == one[key], key
    assert two["prefix_hits"] > 0 and two["prefix_hits"] == one["prefix_hits"]


def test_speculative_verification_steps_on_two_ranks_match_plain_decode(runs):
    _, one, two = runs
    assert two["speculative"] == two["plain_after_loop"] == one["speculative"]
    # Verification steps ran (proposals made) and took the same decisions on both sizes.
    assert two["spec_counts"][0] > 0 and two["spec_counts"] == one["spec_counts"]


def test_a_draft_model_beside_two_ranks_proposes_and_leaves_the_output_unchanged(runs):
    _, one, two = runs
    assert two["draft"] == two["plain_draft_prompts"] == one["draft"]
    # The draft is the model itself: it proposed, and every proposal was accepted.
    assert two["draft_counts"][0] > 0 and two["draft_counts"][0] == two["draft_counts"][1]
    assert two["draft_counts"] == one["draft_counts"]


@pytest.mark.parametrize("shape", ["tied", "attention_bias"])
def test_each_rank_holds_its_share_of_the_weights(tmp_path, shape):
    make_checkpoint(tmp_path, **SHAPES[shape])
    config = Qwen3Config.from_json(tmp_path)
    whole = load_model(tmp_path, config, torch.device("cpu"), torch.float32)

    def layer_bytes(model) -> int:
        return sum(p.numel() * p.element_size() for p in model.model.layers.parameters())

    ranks = [load_model(tmp_path, config, torch.device("cpu"), torch.float32, TensorParallel(r, 2)) for r in (0, 1)]
    for model in ranks:
        assert abs(layer_bytes(model) / layer_bytes(whole) - 0.5) <= 0.05  # within 10% of half
    # The shards put together are the checkpoint's tensors, read here straight from the file.
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.down_proj.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
    q_rows = q.shape[0] // 2
    assert torch.equal(torch.cat([m.model.layers[0].self_attn.qkv_proj.weight[:q_rows] for m in ranks]), q)
    assert torch.equal(torch.cat([m.model.layers[0].mlp.down_proj.weight for m in ranks], dim=1), down)
    assert torch.equal(torch.cat([m.model.embed_tokens.weight for m in ranks]), embed)
    if config.attention_bias:  # a row-parallel bias counts once: rank 0 holds it, the other rank zeros
        assert torch.equal(ranks[0].model.layers[0].self_attn.o_proj.bias, whole.model.layers[0].self_attn.o_proj.bias)
        assert not ranks[1].model.layers[0].self_attn.o_proj.bias.any()


def test_sizes_that_do_not_divide_are_refused_naming_the_numbers(tmp_path):
    make_checkpoint(tmp_path, num_attention_heads=4, num_key_value_heads=2, intermediate_size=90)
    config = Qwen3Config.from_json(tmp_path)
    with pytest.raises(ConfigError, match=r"size 4 must divide num_key_value_heads \(2\), intermediate_size \(90\)"):
        check_divisible(config, 4)
    with pytest.raises(ConfigError, match=r"size 3 must divide num_attention_heads \(4\)"):
        LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", num_blocks=8, tensor_parallel_size=3))
    check_divisible(config, 2)


GROUPS_PROBE = """
import torch, torch.distributed as dist
from services.model_worker.distributed.group import _join, private_store
from services.model_worker.distributed.parallel import TensorParallel
store, _ = private_store(1)  # the rendezvous the worker's ranks use
tp = TensorParallel(0, 1)
_join(store, tp, torch.device("cpu"))
tp.size = 2  # one process, but take the collective paths a real group takes
out = {"min": tp.min(7), "sum": tp.all_reduce(torch.ones(2)).tolist()}
try:
    dist.all_reduce(torch.ones(1))
    out["default"] = "ran"
except RuntimeError as e:
    out["default"] = str(e)
tp.cpu_group = None  # what a min on the default group would meet
try:
    tp.min(7)
    out["min_on_default"] = "ran"
except RuntimeError as e:
    out["min_on_default"] = str(e)
# Without this, the groups' threads are torn down by the interpreter's exit, which now and then
# aborts the process ("terminate called without an active exception") after the result is printed.
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_host_collectives_never_use_the_default_group_which_has_no_cpu_backend():
    """As on GPUs, where the default group is NCCL: a CPU tensor on it fails, so CPU runs catch one left there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", "import json\n" + GROUPS_PROBE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["min"] == 7 and out["sum"] == [1.0, 1.0]
    assert "No backend type associated with device type cpu" in out["default"]
    assert "No backend type associated with device type cpu" in out["min_on_default"]


STORE_PROBE = """
import os, subprocess, json
from services.model_worker.distributed.group import private_store
store, directory = private_store(1)
store.set("k", "v")
listening = [line for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
             if f"pid={os.getpid()}," in line]
print(json.dumps({"mode": os.stat(directory).st_mode & 0o777, "listening": listening, "value": store.get("k").decode(),
                  "owner": os.stat(directory).st_uid == os.getuid()}))
"""


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss to list listening sockets")
def test_the_rendezvous_opens_no_port_and_only_its_user_can_reach_it():
    env = {**os.environ, "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", STORE_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["value"] == "v" and out["owner"]
    assert out["mode"] == 0o700
    assert out["listening"] == []
