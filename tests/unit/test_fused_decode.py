"""The fused decode loop (kernels/decoder.c, fused_decode.py): bit for bit the layer-by-layer forward, and
used only for the steps it takes."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.kernels import build, cpu_attention, cpu_decoder, cpu_prefill_attention
from services.model_worker.model.fused_decode import FusedDecode
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from services.model_worker.model.layers.attention.sdpa import TorchAttention
from tests.checkpoints import make_checkpoint
from tests.unit.test_engine_reference import random_prompt

pytestmark = pytest.mark.skipif("avx512_bf16" not in build.cpu_features(),
                                reason="the fused loop calls the AVX512-BF16 matmul kernel")


@pytest.fixture(scope="module")
def library():
    library = cpu_decoder.load()
    assert library is not None, "the fused loop must build on a CPU with AVX-512 (gcc is on the test machine)"
    return library


def test_silu_and_mul_rounds_as_torch_for_every_bf16_gate(library):
    """Every one of the 65,536 bf16 values as the gate, times random up values: F.silu(gate) * up, bit for bit."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    up = torch.randn(65536, generator=torch.Generator().manual_seed(3)).bfloat16()
    up[::7] = 1.0  # the SiLU itself, unmultiplied
    rows = 16
    gate_up = torch.cat((gate.view(rows, -1), up.view(rows, -1)), dim=1).contiguous()
    act = torch.empty(rows, 65536 // rows, dtype=torch.bfloat16)
    assert library.silu_and_mul(ctypes.c_void_p(gate_up.data_ptr()), ctypes.c_void_p(act.data_ptr()), rows,
                                ctypes.c_int64(65536 // rows)) == 0
    want = (F.silu(gate) * up).view(rows, -1)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(act), nan)
    assert torch.equal(act.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.fixture(scope="module", params=["tiny", "gqa4-head64"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"fused-{request.param}")
    overrides = {} if request.param == "tiny" else dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    make_checkpoint(path, eos_token_id=(), num_hidden_layers=3, **overrides)
    return path


def make_engine(checkpoint, fused: bool, max_num_seqs: int = 64) -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=4 * max(64, max_num_seqs),
                                              block_size=8, fused_decode=fused,
                                              limits=SchedulerLimits(max_num_seqs=max_num_seqs)))


def hidden_states(engine: LLMEngine, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """The final hidden states each step samples from, for greedy continuations of the prompts."""
    captured = []
    compute_logits = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: (captured.append(hidden.clone()), compute_logits(hidden))[1]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    return captured


def step_meta(query_lens: list[int], backend) -> AttentionMetadata:
    """A step's metadata: sequence i with query_lens[i] new tokens of 4 in its context, in block i."""
    return AttentionMetadata.build([[i] for i in range(len(query_lens))], [4] * len(query_lens), query_lens, 8,
                                   torch.device("cpu"), backend)


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 9, 130])
def test_fused_steps_equal_the_layer_by_layer_forward_bit_for_bit(checkpoint, batch, monkeypatch):
    """1-2 rows take the AVX512-BF16 matmul kernel, 3 and more the AMX one where the CPU has it (else
    up to 4, and 5 and 9 rows run layer by layer in both engines); weights in VNNI order take every count,
    130 included."""
    # Short prompts in a large batch, so that all of them run in one decode step.
    prompts = [random_prompt(3 + 4 * i if batch < 10 else 1 + i % 2, seed=batch * 10 + i) for i in range(batch)]
    plain = hidden_states(make_engine(checkpoint, False, max_num_seqs=batch), prompts, 6)
    calls = []
    real = cpu_decoder.decode_layers
    monkeypatch.setattr(cpu_decoder, "decode_layers", lambda *args: (calls.append(args[4].shape[0]), real(*args))[1])
    engine = make_engine(checkpoint, True, max_num_seqs=batch)
    fused = hidden_states(engine, prompts, 6)
    assert len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))
    if batch <= engine.model.model.fused_decode.max_rows:
        assert calls == [batch] * 5  # every decode step (the prompts' prefill runs layer by layer)
    else:
        assert calls == []


def test_the_engine_uses_it_by_default_in_bf16_only(checkpoint):
    default = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16, block_size=8))
    assert isinstance(default.model.model.fused_decode, FusedDecode)
    fp32 = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", num_blocks=16, block_size=8))
    assert fp32.model.model.fused_decode is None
    unfused = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16, block_size=8,
                                                 norm_kernel=False))
    assert unfused.model.model.fused_decode is None  # the norms run in torch: nothing to fuse with
    for where_it_cannot in (dict(dtype="bfloat16", norm_kernel=False), dict(dtype="bfloat16", small_batch_kernel=False),
                            dict(dtype="float32")):
        with pytest.raises(ValueError, match="fused_decode needs"):
            LLMEngine(checkpoint, EngineConfig(device="cpu", num_blocks=16, block_size=8, fused_decode=True,
                                               **where_it_cannot))


def test_it_takes_pure_decode_steps_of_few_rows_on_the_c_attention_kernel(checkpoint):
    fused = make_engine(checkpoint, True).model.model.fused_decode
    kernel = CpuPagedAttention(cpu_attention.load())

    def meta(query_lens, backend=kernel):
        return step_meta(query_lens, backend)

    def hidden(rows):
        return torch.zeros(rows, 64, dtype=torch.bfloat16)

    assert fused.takes(hidden(2), meta([1, 1]))
    assert not fused.takes(hidden(4), meta([1, 3]))                      # a prompt chunk in the step
    assert not fused.takes(hidden(2), meta([1, 1], TorchAttention()))   # another attention backend
    assert not fused.takes(hidden(2).float(), meta([1, 1]))
    if fused.prompts:  # weights in VNNI order: one kernel at every row count, past the AMX kernel's 128
        assert fused.takes(hidden(300), meta([1] * 300))
    else:
        rows = fused.max_rows + 1
        assert not fused.takes(hidden(rows), meta([1] * rows))


def test_the_c_loop_refuses_more_rows_than_its_matmul_kernels_take(library):
    kernels = cpu_decoder.Kernels(small_max_rows=4, amx_min_rows=3, amx_max_rows=128)  # no AMX kernel given
    shape = cpu_decoder.Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, block_size=8,
                              num_slots=64, eps=1e-6, scale=0.25)
    layers = (cpu_decoder.Layer * 1)()
    rope = (torch.zeros(5, 1, 16, dtype=torch.bfloat16),) * 2
    with pytest.raises(RuntimeError, match="decode_layers failed with status -1 for 5 rows"):
        cpu_decoder.decode_layers(library, kernels, shape, layers, torch.zeros(5, 64, dtype=torch.bfloat16), rope,
                                  torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.int32),
                                  torch.zeros(5, 1, dtype=torch.int32))


def test_the_layer_by_layer_mlp_takes_the_c_activation_and_matches_torch_bit_for_bit(library):
    """Prefill rows go through Qwen3MLP.forward: with the C SiLU-and-product its output equals torch's ops'."""
    from services.model_worker.config.model import Qwen3Config
    from services.model_worker.distributed.parallel import TensorParallel
    from services.model_worker.model.fused_decode import use_activation_kernel
    from services.model_worker.model.qwen3 import Qwen3MLP

    config = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, vocab_size=128)
    mlp = Qwen3MLP(config, TensorParallel()).bfloat16()
    torch.manual_seed(0)
    for p in mlp.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(37, 64).bfloat16()
    want = mlp(x)
    assert use_activation_kernel(mlp, library) == 1 and mlp.act_kernel is library
    calls = []
    original = cpu_decoder.silu_and_mul
    try:
        cpu_decoder.silu_and_mul = lambda *a: calls.append(1) or original(*a)
        got = mlp(x)
    finally:
        cpu_decoder.silu_and_mul = original
    assert calls == [1]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# Head sizes the prefill attention kernel takes (a multiple of 32), widths the VNNI kernel takes.
PROMPT_SHAPES = {"gqa2-head32": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),
                 "gqa4-head64": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64)}


def make_prompt_checkpoint(path, shape: str):
    """A 3-layer checkpoint of PROMPT_SHAPES[shape], whose steps with prompts the fused loop takes."""
    make_checkpoint(path, eos_token_id=(), num_hidden_layers=3, **PROMPT_SHAPES[shape])
    return path


@pytest.fixture(scope="module", params=list(PROMPT_SHAPES))
def prompt_checkpoint(request, tmp_path_factory):
    return make_prompt_checkpoint(tmp_path_factory.mktemp(f"fused-prompts-{request.param}"), request.param)


def staggered_hidden(engine: LLMEngine, arrivals: dict[int, list[list[int]]], new_tokens: int) -> list[torch.Tensor]:
    """The final hidden states of every step's sampled rows, with arrivals[s]'s prompts added before step s."""
    captured = []
    compute_logits = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: (captured.append(hidden.clone()), compute_logits(hidden))[1]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for i, prompt in enumerate(arrivals.get(step, [])):
            engine.add_request(f"s{step}-{i}", prompt, params)
        engine.step()
        step += 1
    return captured


def prompt_engine(checkpoint, fused: bool, budget: int = 2048, kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=256, block_size=8,
                                              fused_decode=fused, kv_cache_dtype=kv_cache_dtype,
                                              limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=budget)))


SCENARIOS = {
    # one step of four fresh prompts, then their decodes
    "fresh prompts together": (2048, {0: [random_prompt(n, seed=n) for n in (5, 17, 32, 40)]}),
    # prompts chunked to 24-token steps (later chunks attend over cached keys), arriving while others decode
    "chunked beside decodes": (24, {0: [random_prompt(30, seed=1)], 2: [random_prompt(9, seed=2)],
                                    3: [random_prompt(61, seed=3), random_prompt(2, seed=4)]}),
    # the second prompt finds the first one's 24-token prefix in the prefix cache: a prompt with cached keys
    "a prefix-cache hit": (2048, {0: [random_prompt(27, seed=5)],
                                  4: [random_prompt(27, seed=5)[:24] + random_prompt(6, seed=6)]}),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_steps_with_prompts_equal_the_layer_by_layer_forward_bit_for_bit(prompt_checkpoint, scenario, monkeypatch):
    budget, arrivals = SCENARIOS[scenario]
    plain = staggered_hidden(prompt_engine(prompt_checkpoint, False, budget), arrivals, 5)
    steps = []
    real = cpu_decoder.prompt_layers

    def spy(*args):
        prompts = args[7].struct
        slots = ctypes.cast(prompts.key_slots, ctypes.POINTER(ctypes.c_void_p))
        lens = ctypes.cast(prompts.lens, ctypes.POINTER(ctypes.c_int32))
        steps.append((prompts.count, prompts.decodes, sum(slots[i] is not None for i in range(prompts.count)),
                      [lens[i] for i in range(prompts.count)]))
        return real(*args)

    monkeypatch.setattr(cpu_decoder, "prompt_layers", spy)
    engine = prompt_engine(prompt_checkpoint, True, budget)
    assert engine.model.model.fused_decode.prompts, "VNNI weights on an AVX512-BF16 CPU: prompts run in the C loop"
    fused = staggered_hidden(engine, arrivals, 5)
    assert len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))
    assert steps, "no step with prompts went through the C loop"
    if scenario == "fresh prompts together":
        assert steps == [(4, 0, 0, [5, 17, 32, 40])]
    elif scenario == "chunked beside decodes":
        assert any(decodes for _, decodes, _, _ in steps) and any(cached for _, _, cached, _ in steps)
    else:  # the hit: its 6 new rows over 24 cached keys and their own, beside the first request's last decode
        assert steps[-1] == (1, 1, 1, [6])


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_steps_with_prompts_over_an_8bit_cache_equal_the_layer_by_layer_forward(prompt_checkpoint, scenario, kind,
                                                                                   monkeypatch):
    """An 8-bit cache's keys, a fresh prompt's own included, are dequantized in the loop as the layers gather
    them: the same hidden states, bit for bit, and the steps with prompts run in the C loop."""
    budget, arrivals = SCENARIOS[scenario]
    plain = staggered_hidden(prompt_engine(prompt_checkpoint, False, budget, kind), arrivals, 5)
    steps = []
    real = cpu_decoder.prompt_layers
    monkeypatch.setattr(cpu_decoder, "prompt_layers", lambda *args: steps.append(args[4].shape[0]) or real(*args))
    fused = staggered_hidden(prompt_engine(prompt_checkpoint, True, budget, kind), arrivals, 5)
    assert steps, "no step with prompts went through the C loop"
    assert len(fused) == len(plain) and all(torch.equal(a, b) for a, b in zip(fused, plain))


def test_steps_with_prompts_stay_layer_by_layer_where_the_c_loop_cannot_take_them(prompt_checkpoint, checkpoint):
    """SDPA for prompts (no prefill kernel), or head sizes the kernel does not take: the layers run as before."""
    engine = prompt_engine(prompt_checkpoint, True)
    fused = engine.model.model.fused_decode
    sdpa_prompts = CpuPagedAttention(cpu_attention.load())
    with_prefill = CpuPagedAttention(cpu_attention.load(), cpu_prefill_attention.load())
    hidden = torch.zeros(4, 64, dtype=torch.bfloat16)
    assert fused.takes_prompts(hidden, step_meta([1, 3], with_prefill))
    assert not fused.takes_prompts(hidden, step_meta([1, 3], sdpa_prompts))
    assert not fused.takes_prompts(hidden, step_meta([1, 3], TorchAttention()))
    assert not fused.takes_prompts(hidden, step_meta([1, 1, 1, 1], with_prefill))  # a pure decode step: takes()
    assert not fused.takes_prompts(hidden.float(), step_meta([1, 3], with_prefill))
    fused.prompts = False
    assert not fused.takes_prompts(hidden, step_meta([1, 3], with_prefill))
    other = make_engine(checkpoint, True).model.model.fused_decode  # head_dim 16 ("tiny") or 64
    assert other.takes_prompts(hidden, step_meta([1, 3], with_prefill)) == (other.shape["head_dim"] % 32 == 0)
