"""Steps with LoRA adapter rows in the fused CPU loop (kernels/decoder.c): bit for bit the layer-by-layer forward,
base rows beside two adapters of different ranks, in decode steps and (on weights whose kernel takes every row count)
steps with prompts."""
from __future__ import annotations

import pytest
import torch

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_decoder, cpu_lora
from tests.checkpoints import make_checkpoint
from tests.lora_adapters import make_adapter
from tests.unit.test_engine_reference import random_prompt

pytestmark = pytest.mark.skipif("avx512_bf16" not in build.cpu_features(),
                                reason="the fused loop calls the AVX512-BF16 matmul kernel")

ADAPTERS = {
    "every4": dict(rank=4, seed=1, std=0.2),
    # rank 16 over some modules only: the others' parts stay zero in its slot
    "some16": dict(rank=16, seed=2, std=0.2, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
}
# Each step's arrivals: (prompt, adapter); base rows beside both adapters, one prompt on base and on an adapter.
ARRIVALS = {0: [(random_prompt(9, seed=1), ""), (random_prompt(9, seed=1), "every4"),
                (random_prompt(5, seed=2), "some16")],
            2: [(random_prompt(12, seed=3), "some16")]}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A checkpoint whose head size the prefill attention kernel takes, and its adapters' (name, folder)."""
    path = tmp_path_factory.mktemp("lora-fused-base")
    make_checkpoint(path, eos_token_id=(), num_hidden_layers=3, head_dim=32)
    modules = []
    for name, kwargs in ADAPTERS.items():
        folder = tmp_path_factory.mktemp(name)
        make_adapter(path, folder, **kwargs)
        modules.append((name, str(folder)))
    return path, tuple(modules)


WEIGHTS = {"vnni": dict(), "plain": dict(vnni_weights=False), "int8": dict(quantization="int8")}


def make_engine(adapters, fused: bool, weights: str) -> LLMEngine:
    path, modules = adapters
    return LLMEngine(path, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=128, block_size=4,
                                        fused_decode=fused, enable_lora=True, max_loras=2, max_lora_rank=16,
                                        lora_modules=modules, limits=SchedulerLimits(4, 16, 64), **WEIGHTS[weights]))


def run(engine: LLMEngine, arrivals: dict, new_tokens: int = 6) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every step's final hidden states of its sampled rows, and each request's greedy tokens."""
    captured = []
    compute_logits = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: (captured.append(hidden.clone()), compute_logits(hidden))[1]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"s{step}-{i}" for step, requests in sorted(arrivals.items()) for i in range(len(requests))]
    tokens = {rid: [] for rid in ids}
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for i, (prompt, adapter) in enumerate(arrivals.get(step, [])):
            engine.add_request(f"s{step}-{i}", prompt, params, adapter=adapter)
        for out in engine.step():
            tokens[out.request_id].append(out.token_id)
        step += 1
    return captured, [tokens[rid] for rid in ids]


def spy_on_the_loop(monkeypatch) -> list[tuple[str, int]]:
    """(which call, adapter segments) of each fused step, 0 segments for a step without adapter rows."""
    calls = []
    for name, at in (("decode_layers", 9), ("prompt_layers", 8)):  # where each call takes its adapter rows
        def spy(*args, real=getattr(cpu_decoder, name), name=name, at=at):
            lora = args[at]
            calls.append((name, 0 if lora is None else lora.segments))
            return real(*args)
        monkeypatch.setattr(cpu_decoder, name, spy)
    return calls


@pytest.mark.parametrize("weights", WEIGHTS)
def test_adapter_steps_in_the_fused_loop_equal_the_layer_by_layer_forward_bit_for_bit(adapters, weights,
                                                                                       monkeypatch):
    """VNNI weights, and int8 weights times int8 activations (on VNNI or AMX-INT8), take every step here (prompts
    too); plain bf16 weights the decode steps."""
    plain_hidden, plain_tokens = run(make_engine(adapters, False, weights), ARRIVALS)
    calls = spy_on_the_loop(monkeypatch)
    engine = make_engine(adapters, True, weights)
    assert engine.model.model.fused_decode.takes_lora()
    hidden, tokens = run(engine, ARRIVALS)
    assert len(hidden) == len(plain_hidden) and all(torch.equal(a, b) for a, b in zip(hidden, plain_hidden))
    assert tokens == plain_tokens
    assert tokens[0] != tokens[1], "the same prompt on the base and on an adapter: else LoRA was never applied"
    assert ("decode_layers", 2) in calls  # decode steps with both adapters' rows ran in the loop
    if weights == "vnni" or engine.model.model.fused_decode.prompts:
        assert engine.model.model.fused_decode.prompts
        assert ("prompt_layers", 2) in calls  # prompt chunks (some over cached keys) with adapter rows
    else:
        assert not any(name == "prompt_layers" for name, _ in calls)


def test_adapter_steps_run_layer_by_layer_where_lora_c_does_not_build(adapters, monkeypatch):
    """The layers' add_lora then takes torch's SGMV, whose sums the loop does not repeat."""
    engine = make_engine(adapters, True, "vnni")
    monkeypatch.setattr(cpu_lora, "load", lambda: None)
    calls = spy_on_the_loop(monkeypatch)
    assert not engine.model.model.fused_decode.takes_lora()
    hidden, tokens = run(engine, ARRIVALS)
    assert hidden and all(segments == 0 for _, segments in calls)
    assert tokens[0] != tokens[1]
