"""LoRA adapters in the engine against transformers + peft on the same random checkpoint and adapters, in float32:
greedy tokens per adapter, and a batch mixing adapters with the base giving each request what it gets alone."""
from __future__ import annotations

import pytest

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import greedy_reference, make_adapter

LENGTH = 12
PROMPTS = [[5, 17, 300, 41, 9, 88, 120, 3, 77], [400, 2, 19, 250], [33, 61, 7, 7, 7, 90, 11, 205, 13, 500, 1, 64]]
ADAPTERS = {
    # every target module, rank 8
    "all8": dict(rank=8, seed=1),
    # rank 16 (the largest served), attention and MLP modules, rsLoRA scaling
    "mixed16": dict(rank=16, seed=2, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], use_rslora=True,
                    lora_alpha=8),
    # a regex: only layer 1's MLP
    "regex4": dict(rank=4, seed=3, target_modules=r"model\.layers\.1\.mlp\.(gate|up|down)_proj", std=0.3),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora-base")
    base = make_checkpoint(path, eos_token_id=())
    references, modules = {"": base}, []
    for name, kwargs in ADAPTERS.items():
        folder = tmp_path_factory.mktemp(name)
        references[name] = make_adapter(path, folder, **kwargs)
        modules.append((name, str(folder)))
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=128, block_size=4,
                                          enable_lora=True, max_loras=4, max_lora_rank=16,
                                          lora_modules=tuple(modules), limits=SchedulerLimits(16, 16, 64)))
    return engine, references, path, tuple(modules)


def run(engine: LLMEngine, requests: list[tuple[list[int], str]]) -> list[list[int]]:
    """Greedy tokens of (prompt, adapter) requests run together."""
    ids = [f"r{i}-{id(requests)}" for i in range(len(requests))]
    for rid, (prompt, adapter) in zip(ids, requests):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True),
                           adapter=adapter)
    out = {rid: [] for rid in ids}
    while engine.has_work():
        for step in engine.step():
            out[step.request_id].append(step.token_id)
    return [out[rid] for rid in ids]


@pytest.mark.parametrize("adapter", ["", *ADAPTERS])
def test_greedy_tokens_match_peft(setup, adapter):
    engine, references, _, _ = setup
    for prompt in PROMPTS[:2]:
        assert run(engine, [(prompt, adapter)])[0] == greedy_reference(references[adapter], prompt, LENGTH)


def test_adapters_change_the_tokens(setup):
    """Else the comparisons above could pass with LoRA never applied."""
    engine, _, _, _ = setup
    outputs = [run(engine, [(PROMPTS[0], adapter)])[0] for adapter in ["", *ADAPTERS]]
    assert len({tuple(o) for o in outputs}) == len(outputs)


def test_a_mixed_batch_gives_each_request_what_it_gets_alone(setup):
    engine, _, _, _ = setup
    requests = [(PROMPTS[0], ""), (PROMPTS[1], "all8"), (PROMPTS[2], "mixed16"), (PROMPTS[0], "all8"),
                (PROMPTS[2], ""), (PROMPTS[1], "regex4"), (PROMPTS[0], "mixed16")]
    alone = [run(engine, [r])[0] for r in requests]
    assert run(engine, requests) == alone


def test_a_resumed_request_keeps_its_adapter(setup):
    engine, _, _, _ = setup
    whole = run(engine, [(PROMPTS[1], "all8")])[0]
    seq = engine.new_sequence("resumed", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=LENGTH,
                                                                    ignore_eos=True), whole[:5], adapter="all8")
    engine.admit(seq)
    rest = []
    while engine.has_work():
        rest += [s.token_id for s in engine.step()]
    assert rest == whole[5:]


class CountingFusedDecode:
    """The model's fused decode loop, counting the steps it runs."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def takes(self, *args):
        return self.inner.takes(*args)

    def takes_prompts(self, *args):
        return self.inner.takes_prompts(*args)

    def takes_lora(self):
        return self.inner.takes_lora()

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def test_base_steps_and_adapter_steps_take_the_fused_decode_loop(setup):
    """In bf16; tests/unit/test_lora_fused_decode.py checks the loop's adapter steps bit for bit."""
    _, _, path, modules = setup
    config = dict(device="cpu", dtype="bfloat16", num_blocks=64, block_size=4)
    plain = LLMEngine(path, EngineConfig(**config))
    lora = LLMEngine(path, EngineConfig(**config, enable_lora=True, lora_modules=modules))
    if lora.model.model.fused_decode is None:
        pytest.skip("this CPU or compiler has no fused decode loop")
    fused = lora.model.model.fused_decode = CountingFusedDecode(lora.model.model.fused_decode)
    base = run(lora, [(PROMPTS[0], "")])[0]
    assert base == run(plain, [(PROMPTS[0], "")])[0] and fused.calls >= LENGTH - 1
    before = fused.calls
    adapted = run(lora, [(PROMPTS[0], "all8"), (PROMPTS[1], "mixed16")])
    assert fused.calls >= before + LENGTH - 1 and adapted[0] != base
