"""KV cache sizing on a GPU, from a (fake) memory reading: the arithmetic and the refusals."""
import pytest
import torch

from services.model_worker.config.model import ConfigError
from services.model_worker.executor.kv_sizing import GIB, GpuMemory, plan_kv_cache

MIB = 1 << 20
H200 = 141 * GIB


def plan(memory, utilization=0.9, bytes_per_block=2 * MIB, block_size=16, max_model_len=4096, max_num_seqs=1000):
    return plan_kv_cache(memory, utilization, bytes_per_block, block_size, max_model_len, max_num_seqs)


def test_the_cache_gets_the_allowed_share_less_weights_and_the_measured_peak():
    memory = GpuMemory(total=80 * GIB, free=78 * GIB, weights=16 * GIB, peak_activations=3 * GIB)
    result = plan(memory, utilization=0.5)
    assert result.budget == 40 * GIB - 16 * GIB - 3 * GIB
    assert result.num_blocks == 21 * GIB // (2 * MIB)
    assert "0.5 x 80.0 GiB" in result.summary and "peak activations 3.00 GiB" in result.summary


def test_other_processes_memory_is_never_planned_for():
    # Utilisation allows 72 GiB but another process holds 60 GiB: only what is free counts.
    memory = GpuMemory(total=80 * GIB, free=20 * GIB - 1 * GIB, weights=1 * GIB, peak_activations=2 * GIB)
    result = plan(memory)
    assert result.budget == 17 * GIB
    assert result.num_blocks == 17 * GIB // (2 * MIB)


def test_small_models_take_only_what_every_sequence_at_full_length_needs():
    memory = GpuMemory(total=H200, free=H200, weights=GIB, peak_activations=GIB)
    result = plan(memory, max_model_len=1000, max_num_seqs=8)
    assert result.num_blocks == 8 * 63  # 63 blocks of 16 hold 1000 tokens


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.01, 2.0])
def test_utilization_outside_zero_one_is_refused(utilization):
    memory = GpuMemory(total=80 * GIB, free=80 * GIB, weights=GIB, peak_activations=GIB)
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization must be in \(0, 1\]"):
        plan(memory, utilization=utilization)
    assert plan(memory, utilization=1.0).num_blocks > 0


def test_a_cache_that_cannot_hold_one_full_sequence_refuses_naming_the_flags():
    # 0.2 x 24 GiB = 4.8 GiB, less 4 GiB of weights and 0.5 GiB of activations: 0.3 GiB, 153 blocks,
    # 2,448 tokens; one sequence of 4,096 tokens needs 256 blocks.
    memory = GpuMemory(total=24 * GIB, free=23 * GIB, weights=4 * GIB, peak_activations=GIB // 2)
    with pytest.raises(ConfigError) as refused:
        plan(memory, utilization=0.2, max_model_len=4096)
    message = str(refused.value)
    for flag in ("--gpu-memory-utilization", "--max-model-len"):
        assert flag in message
    assert "4096" in message and "2448 tokens" in message
    assert plan(memory, utilization=0.2, max_model_len=2048).num_blocks == 153


def test_weights_larger_than_the_share_refuse_instead_of_a_negative_cache():
    memory = GpuMemory(total=24 * GIB, free=23 * GIB, weights=20 * GIB, peak_activations=GIB)
    with pytest.raises(ConfigError, match="would hold 0 tokens"):
        plan(memory, utilization=0.5, max_model_len=16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_profiling_on_the_gpu_measures_a_peak_and_sizes_a_cache(tmp_path):
    from services.model_worker.config.engine import EngineConfig
    from services.model_worker.engine.llm_engine import LLMEngine
    from tests.checkpoints import make_checkpoint
    make_checkpoint(tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(device="cuda", dtype="float32", gpu_memory_utilization=0.3,
                                              max_model_len=512))
    free, total = torch.cuda.mem_get_info()
    used = engine.kv_cache.num_blocks * engine.kv_cache.bytes_per_block(engine.config, 16, torch.float32)
    assert engine.kv_cache.num_blocks >= 32 and used <= 0.3 * total


def profiling_engine(tmp_path, monkeypatch):
    """A float32 CPU engine on the test checkpoint, and kv_sizing with torch.cuda's memory readings faked:
    100 MiB before the warm-up cache, 103 MiB with it, a 150 MiB peak, 60 of 80 GiB free."""
    from services.model_worker.config.engine import EngineConfig
    from services.model_worker.engine.llm_engine import LLMEngine
    from services.model_worker.executor import kv_sizing as profile
    from tests.checkpoints import make_checkpoint
    make_checkpoint(tmp_path)
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", num_blocks=8, block_size=16))
    allocated = iter([100 * MIB, 103 * MIB])  # before the warm-up cache, then with it (3 MiB)
    readings = dict(memory_allocated=lambda device: next(allocated), max_memory_allocated=lambda device: 150 * MIB,
                    mem_get_info=lambda device: (60 * GIB, 80 * GIB), synchronize=lambda device=None: None,
                    empty_cache=lambda: None, reset_peak_memory_stats=lambda device: None)
    for name, fake in readings.items():
        monkeypatch.setattr(profile.torch.cuda, name, fake)
    return engine, profile


def test_profiling_runs_the_largest_step_and_reports_what_it_measured(tmp_path, monkeypatch):
    """The profiling pass on CPU, with torch.cuda's memory readings faked: what it runs and returns."""
    from services.model_worker.config.engine import SchedulerLimits
    engine, profile = profiling_engine(tmp_path, monkeypatch)
    steps = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda ids, *a: steps.append(ids.shape[0]) or forward(ids, *a))
    rows, compute_logits = [], engine.model.compute_logits
    monkeypatch.setattr(engine.model, "compute_logits", lambda h: rows.append(h.shape[0]) or compute_logits(h))
    scored = []
    monkeypatch.setattr(profile, "score_rows", lambda logits, targets, top: scored.append((logits.shape, top)))
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=200)
    memory = profile.profile_step_memory(engine.model, engine.sampler, engine.config, engine.device, torch.float32,
                                         16, limits)
    assert steps == [200]  # one forward of --max-num-batched-tokens tokens
    # Prompt logprobs of a whole chunk (20 best each) beside the logits of --max-num-seqs sampled rows.
    assert sorted(rows) == [4, 200]
    assert scored == [((200, engine.config.vocab_size), [20] * 200)]
    assert memory == GpuMemory(total=80 * GIB, free=60 * GIB, weights=100 * MIB, peak_activations=47 * MIB)


def test_profiling_counts_the_penalty_state_and_a_penalised_draw(tmp_path, monkeypatch):
    """The penalty state's rows (allocated lazily by the engine, kept after) exist while the profiled step runs,
    with the state's own shapes, and the draw reads them as a penalised batch of --max-num-seqs rows does."""
    from services.model_worker.config.engine import SchedulerLimits
    from services.model_worker.executor.penalty_state import PenaltyState
    engine, profile = profiling_engine(tmp_path, monkeypatch)
    monkeypatch.setattr(profile, "score_rows", lambda logits, targets, top: None)
    draws = []
    monkeypatch.setattr(engine, "sampler", lambda logits, params, penalties, keys: draws.append((params, penalties)))
    limits = SchedulerLimits(max_num_seqs=6, max_num_batched_tokens=64)
    profile.profile_step_memory(engine.model, engine.sampler, engine.config, engine.device, torch.float32, 16, limits)
    [(params, penalties)] = draws
    assert len(params) == 6 and all(p.has_penalties and p.repetition_penalty != 1.0 and p.presence_penalty
                                    and p.frequency_penalty for p in params)
    state = PenaltyState(6, engine.device)
    state.rows([_Penalised()], engine.config.vocab_size, None)  # what the engine allocates at its first one
    for profiled, kept in ((penalties.seen, state.seen), (penalties.counts, state.counts)):
        assert (profiled.shape, profiled.dtype) == (kept.shape, kept.dtype)
    assert penalties.rows is None and penalties.slots.tolist() == list(range(6))


class _Penalised:
    """The little of a Sequence PenaltyState reads, for one with a presence penalty in slot 0."""
    has_penalties = True
    slot = 0
    num_preemptions = 0
    num_pending = 0
    prompt_ids = [1, 2]
    output_ids = []


@pytest.mark.parametrize("max_len, lengths", [(None, [512, 512, 76]), (300, [300, 300, 300, 200])])
def test_a_profiling_step_longer_than_a_sequence_is_several_prompts(tmp_path, monkeypatch, max_len, lengths):
    """--max-num-batched-tokens past the rotary table (512 positions here) or --max-model-len: the warm-up
    is prompts no longer than a sequence may be, since a position past the table indexes out of bounds
    (a device-side assert on a GPU)."""
    from services.model_worker.config.engine import SchedulerLimits
    engine, profile = profiling_engine(tmp_path, monkeypatch)
    positions = []
    forward = engine.model.forward
    monkeypatch.setattr(engine.model, "forward",
                        lambda ids, pos, *a: positions.append(pos.clone()) or forward(ids, pos, *a))
    monkeypatch.setattr(profile, "score_rows", lambda logits, targets, top: None)
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=sum(lengths))
    profile.profile_step_memory(engine.model, engine.sampler, engine.config, engine.device, torch.float32, 16, limits,
                                max_len)
    [step] = positions
    starts = (step == 0).nonzero().flatten().tolist()
    assert [end - start for start, end in zip(starts, starts[1:] + [len(step)])] == lengths
    assert int(step.max()) < (max_len or engine.config.max_position_embeddings)
