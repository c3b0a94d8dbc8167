"""What the worker refuses about LoRA adapters, with a message that says why: folders it cannot serve, unknown
adapters, LoRA off; and how slots are shared: eviction of idle adapters, unloading while requests run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rpcserver.errors import InvalidArgument, NotFound, ResourceExhausted
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import Qwen3Config
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.model.lora.peft_folder import AdapterError, read_adapter
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-refusals-base")
    make_checkpoint(path, eos_token_id=())
    adapters = {}
    for name, rank in (("a", 8), ("b", 4), ("c", 16)):
        adapters[name] = tmp_path_factory.mktemp(f"adapter-{name}")
        make_adapter(path, adapters[name], rank=rank, seed=rank)
    return path, adapters


def broken(folders, tmp_path, edit_config=None, edit_weights=None):
    """A copy of adapter "a" with its config or weights changed."""
    _, adapters = folders
    folder = tmp_path / "broken"
    shutil.copytree(adapters["a"], folder)
    if edit_config:
        raw = json.loads((folder / "adapter_config.json").read_text())
        edit_config(raw)
        (folder / "adapter_config.json").write_text(json.dumps(raw))
    if edit_weights:
        weights = load_file(folder / "adapter_model.safetensors")
        edit_weights(weights)
        save_file(weights, folder / "adapter_model.safetensors")
    return folder


def refusal(folders, folder, max_rank=16) -> str:
    with pytest.raises(AdapterError) as refused:
        read_adapter(folder, Qwen3Config.from_json(folders[0]), max_rank)
    return str(refused.value)


def test_folders_that_cannot_be_served(folders, tmp_path):
    assert "no adapter folder" in refusal(folders, tmp_path / "missing")
    pickled = broken(folders, tmp_path)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    assert "adapter_model.bin only" in refusal(folders, pickled)
    assert "--max-lora-rank 4" in refusal(folders, folders[1]["a"], max_rank=4)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(target_modules=["q_proj", "lm_head"]), "['lm_head'] cannot be served"),
    (lambda c: c.update(target_modules="(unclosed"), "not a valid regular expression"),
    (lambda c: c.update(bias="all"), "bias 'all' is not served"),
    (lambda c: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda c: c.update(r=0), "r must be a positive integer"),
    (lambda c: c.update(target_modules=["q_proj"]), "not among the target modules"),
    (lambda c: c.update(layers_to_transform=[0]), "outside the adapter's layers"),
    (lambda c: c.update(peft_type="IA3"), "only LORA adapters"),
])
def test_configs_that_cannot_be_served(folders, tmp_path, edit, message):
    assert message in refusal(folders, broken(folders, tmp_path, edit_config=edit))


def test_shape_mismatch(folders, tmp_path):
    def narrow(weights):
        name = next(n for n in weights if "layers.0.self_attn.q_proj.lora_B" in n)
        weights[name] = weights[name][:-1].contiguous()
    assert "layer 0 q_proj" in refusal(folders, broken(folders, tmp_path, edit_weights=narrow))


def test_layers_to_transform_is_honoured(folders, tmp_path):
    def only_layer_1(weights):
        for name in [n for n in weights if ".layers.0." in n]:
            del weights[name]
    folder = broken(folders, tmp_path, edit_config=lambda c: c.update(layers_to_transform=[1]),
                    edit_weights=only_layer_1)
    adapter = read_adapter(folder, Qwen3Config.from_json(folders[0]), 16)
    assert {layer for layer, _ in adapter.weights} == {1}


def engine(folders, **config) -> LLMEngine:
    return LLMEngine(folders[0], EngineConfig(device="cpu", dtype="float32", num_blocks=64, block_size=4, **config))


def test_lora_off_and_unknown_adapters(folders):
    off = engine(folders)
    with pytest.raises(InvalidArgument, match=r"LoRA adapters are not enabled \(--enable-lora\)"):
        off.add_request("r", [1, 2, 3], GREEDY, adapter="a")
    on = engine(folders, enable_lora=True, lora_modules=(("a", str(folders[1]["a"])),))
    with pytest.raises(InvalidArgument, match="unknown adapter 'nope'"):
        on.add_request("r", [1, 2, 3], GREEDY, adapter="nope")


def test_full_slots_evict_an_idle_adapter_else_refuse(folders):
    _, adapters = folders
    lora = engine(folders, enable_lora=True, max_loras=2)
    lora.load_adapter("a", str(adapters["a"]))
    lora.load_adapter("b", str(adapters["b"]))
    lora.add_request("busy-a", [1, 2, 3], GREEDY, adapter="a")
    assert lora.load_adapter("c", str(adapters["c"]))["rank"] == 16  # evicts b, idle
    assert sorted(a["name"] for a in lora.adapters.infos()) == ["a", "c"]
    lora.add_request("busy-c", [1, 2, 3], GREEDY, adapter="c")
    with pytest.raises(ResourceExhausted, match="--max-loras"):
        lora.load_adapter("b", str(adapters["b"]))
    with pytest.raises(InvalidArgument, match="already loaded"):
        lora.load_adapter("a", str(adapters["a"]))


def test_unloading_an_adapter_in_use_lets_its_requests_finish(folders):
    _, adapters = folders
    lora = engine(folders, enable_lora=True, max_loras=2)
    lora.load_adapter("a", str(adapters["a"]))
    want = lora.generate([[1, 2, 3]], GREEDY)  # base, for the slot check below
    lora.add_request("running", [5, 6, 7], GREEDY, adapter="a")
    lora.step()
    lora.unload_adapter("a")
    with pytest.raises(InvalidArgument, match="unknown adapter 'a'"):
        lora.add_request("late", [5, 6, 7], GREEDY, adapter="a")
    with pytest.raises(InvalidArgument, match="still unloading"):
        lora.load_adapter("a", str(adapters["a"]))
    tokens = []
    while lora.has_work():
        tokens += [o.token_id for o in lora.step()]
    assert len(tokens) == GREEDY.max_tokens - 1  # it ran to the end
    lora.step()  # the slot is freed at the next step
    assert not lora.adapters.draining and int(lora.executor.lora.state.ranks.sum()) == 0
    assert torch.count_nonzero(lora.executor.lora.layers[0][0].a) == 0
    with pytest.raises(NotFound):
        lora.unload_adapter("a")
    assert lora.generate([[1, 2, 3]], GREEDY) == want
