"""Mixture of experts over two gloo ranks: each expert's intermediate dimension split, the router whole; same as one rank."""
import pytest
import torch
from safetensors import safe_open

from services.model_worker.config.model import ConfigError, Qwen3Config
from services.model_worker.distributed.parallel import TensorParallel, check_divisible
from services.model_worker.model.loader import load_model
from tests.moe_checkpoints import make_moe_checkpoint
from tests.tp_probe import probe, prompt
from tests.unit.test_tensor_parallel import run_probe

SHAPE = dict(num_hidden_layers=3, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
             tie_word_embeddings=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe_tp")
    reference = make_moe_checkpoint(path, **SHAPE)
    return reference, probe(str(path), 1), run_probe(path, 2, path / "tp2.json")


def test_two_ranks_match_one_and_transformers(runs):
    reference, one, two = runs
    with torch.no_grad():
        want = reference(torch.tensor([prompt(37, 1, 512)])).logits[0]
    assert (torch.tensor(two["logits"]) - torch.tensor(one["logits"])).abs().max().item() <= 1e-3
    assert (torch.tensor(two["logits"]) - want).abs().max().item() <= 1e-3
    first = prompt(11, 2, 512)
    with torch.no_grad():
        greedy = reference.generate(torch.tensor([first]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(first):].tolist()
    assert two["greedy"] == greedy and len(set(greedy)) > 3
    for key in ("batched", "chunked", "prefix_hit"):
        assert two[key] == one[key], key
    assert two["prefix_hits"] > 0


def test_each_rank_holds_its_slice_of_every_expert(tmp_path):
    make_moe_checkpoint(tmp_path)
    config = Qwen3Config.from_json(tmp_path)
    ranks = [load_model(tmp_path, config, torch.device("cpu"), torch.float32, TensorParallel(r, 2)) for r in (0, 1)]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        gate = f.get_tensor("model.layers.0.mlp.experts.3.gate_proj.weight")
        up = f.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight")
        down = f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight")
        router = f.get_tensor("model.layers.0.mlp.gate.weight")
    half = config.moe_intermediate_size // 2
    experts = [m.model.layers[0].mlp.experts for m in ranks]
    assert torch.equal(torch.cat([e.w13[3, :half] for e in experts]), gate)
    assert torch.equal(torch.cat([e.w13[3, half:] for e in experts]), up)
    assert torch.equal(torch.cat([e.w2[3] for e in experts], dim=1), down)
    for m in ranks:
        assert torch.equal(m.model.layers[0].mlp.gate.weight, router)


def test_a_size_that_does_not_split_the_experts_is_refused(tmp_path):
    make_moe_checkpoint(tmp_path, moe_intermediate_size=36)
    with pytest.raises(ConfigError, match=r"size 8 must divide .*moe_intermediate_size \(36\)"):
        check_divisible(Qwen3Config.from_json(tmp_path), 8)
