"""Penalty histories kept per slot on the device: built once per admission, fed each step's ids on the device, and
always equal to histories rebuilt from scratch (prompt set + output counts), with async scheduling on and off,
preemption, cancellation and speculative verification."""
from __future__ import annotations

import random

import pytest
import torch

from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.engine.sequence import Sequence
from services.model_worker.executor import penalty_state
from services.model_worker.executor.penalty_state import PenaltyState
from tests.checkpoints import make_checkpoint

VOCAB = 512  # tests/checkpoints.py's tiny model
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-penalty-state")
    make_checkpoint(path, eos_token_id=(7,))
    return path


def from_scratch(seq: Sequence, pending: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's seen row and counts row, by hand."""
    output = seq.output_ids + ([pending] if pending is not None else [])
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[seq.prompt_ids + output] = True
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    return seen, counts


def check_rows(engine: LLMEngine) -> int:
    """Compares every running penalised sequence's rows, where the state holds them; returns how many it did."""
    state, checked = engine.penalties, 0
    for seq in engine.scheduler.running:
        if not seq.has_penalties or not state.holds(seq):
            continue
        pending = None
        if seq.num_pending:
            pending = int(engine._in_flight.sampled.token_ids[seq.pending_row])
        seen, counts = from_scratch(seq, pending)
        assert torch.equal(state.seen[seq.slot], seen), seq
        assert torch.equal(state.counts[seq.slot], counts), seq
        checked += 1
    return checked


def mixed_params(rng: random.Random, max_tokens: int) -> SamplingParams:
    kind = rng.randrange(4)
    penalties = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
                 dict(repetition_penalty=0.9, frequency_penalty=-0.5), {}][kind]
    sampling = dict(temperature=0.9, seed=rng.randrange(1 << 30)) if rng.random() < 0.5 else dict(temperature=0.0)
    return SamplingParams(max_tokens=max_tokens, **sampling, **penalties)


@pytest.mark.parametrize("async_scheduling, speculative", [(False, None), (True, None), (False, "ngram")],
                         ids=["sync", "async", "ngram"])
def test_rows_equal_a_rebuild_after_every_step(checkpoint, async_scheduling, speculative):
    spec = SpeculativeConfig("ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=2) if speculative else None
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=40, block_size=4, async_scheduling=async_scheduling,
        limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=32), speculative=spec))
    rng = random.Random(5)
    requests = [([rng.randrange(VOCAB) for _ in range(rng.randrange(2, 14))], mixed_params(rng, rng.randrange(6, 30)))
                for _ in range(20)]
    checked = steps = 0
    cancelled = False
    while requests or engine.has_work():
        for _ in range(min(len(requests), rng.choice([0, 1, 3]))):
            prompt, params = requests.pop()
            engine.add_request(f"r{len(requests)}", prompt, params)
        engine.step()
        steps += 1
        checked += check_rows(engine)
        if steps == 6 and not cancelled:  # a cancellation while its token may be in flight
            cancelled = engine.abort(engine.scheduler.running[0].request_id)
    assert engine.scheduler.num_preemptions > 0, "the workload must preempt"
    assert checked > 100


def test_rows_are_built_once_per_admission_and_steps_copy_no_history(checkpoint, monkeypatch):
    """32 penalised and plain sequences decoding with preemption: a sequence's rows are built once each time it
    is admitted, and a step copies to the device no more than its rows' slots, whatever the sequences' lengths."""
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=110, block_size=4, async_scheduling=True,
        limits=SchedulerLimits(max_num_seqs=32, max_num_batched_tokens=512)))
    rng = random.Random(1)
    for i in range(32):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 12))]
        penalties = dict(presence_penalty=0.5, repetition_penalty=1.2) if i % 4 else {}
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                           **penalties))
    built: list[tuple[str, int]] = []
    real_rebuild = PenaltyState.rebuild

    def rebuild(self, seqs, pending_ids):
        built.extend((s.request_id, s.num_preemptions) for s in seqs)
        return real_rebuild(self, seqs, pending_ids)

    copied = [0]
    real_to_device = penalty_state.to_device

    def to_device(values, dtype, device):
        copied[0] += len(values)
        return real_to_device(values, dtype, device)

    monkeypatch.setattr(PenaltyState, "rebuild", rebuild)
    monkeypatch.setattr(penalty_state, "to_device", to_device)
    per_step = []
    while engine.has_work():
        before, copied[0] = len(built), 0
        engine.step()
        if len(built) == before:  # steps that build no rows copy at most each row's batch row and slot
            per_step.append(copied[0])
    assert engine.scheduler.num_preemptions > 0, "the workload must preempt"
    assert len(built) == len(set(built)), "a row built twice within one admission"
    readmitted = [b for b in built if b[1] > 0]
    assert readmitted, "a preempted penalised sequence must be rebuilt when readmitted"
    assert len({b[0] for b in built}) == 24
    assert len(per_step) > 40
    assert max(per_step) <= 2 * 32
    # The batch's rows and slots are copied only when they change: most decode steps copy nothing.
    assert sum(1 for n in per_step if n) < len(per_step) // 2


def sequence(request_id: str, prompt: list[int], output: list[int], slot: int) -> Sequence:
    seq = Sequence(request_id, prompt, SamplingParams(presence_penalty=1.0, repetition_penalty=1.1), 50,
                   frozenset())
    for t in output:
        seq.append(t)
    seq.slot = slot
    return seq


def test_a_slot_is_rebuilt_for_a_new_owner_a_readmission_and_after_forget(monkeypatch):
    state = PenaltyState(max_seqs=4, device=CPU)
    a = sequence("a", [1, 2, 2], [3, 3], slot=2)
    state.rows([a], 16, None)
    state.record(torch.tensor([5]))
    a.append(5)
    assert state.holds(a)
    assert torch.equal(state.counts[2], from_counts(16, [3, 3, 5]))
    # Another sequence in the same slot: its own rows, nothing of a's.
    b = sequence("b", [9], [], slot=2)
    state.rows([b], 16, None)
    assert state.seen[2].nonzero().flatten().tolist() == [9]
    assert not state.counts[2].any()
    assert not state.holds(a)
    state.rows([a], 16, None)
    assert torch.equal(state.counts[2], from_counts(16, [3, 3, 5]))
    assert state.seen[2].nonzero().flatten().tolist() == [1, 2, 3, 5]
    # Readmitted after a preemption, even to the slot it had: built again, once.
    built, rebuild = [], state.rebuild
    monkeypatch.setattr(state, "rebuild", lambda seqs, pending: (built.append(seqs), rebuild(seqs, pending)))
    a.num_preemptions += 1
    assert not state.holds(a)
    state.rows([a], 16, None)
    state.rows([a], 16, None)
    assert built == [[a]]
    assert state.holds(a)
    state.forget([a])
    assert not state.holds(a)


def test_a_rebuild_takes_the_token_in_flight_from_the_device():
    state = PenaltyState(max_seqs=2, device=CPU)
    plain = Sequence("p", [4], SamplingParams(), 10, frozenset())
    a = sequence("a", [1], [6], slot=1)
    a.num_pending, a.pending_row = 1, 2
    penalties = state.rows([plain, a], 16, pending_ids=torch.tensor([0, 0, 11]))
    assert penalties.rows.tolist() == [1] and penalties.slots.tolist() == [1]
    assert torch.equal(state.counts[1], from_counts(16, [6, 11]))
    assert state.seen[1].nonzero().flatten().tolist() == [1, 6, 11]


def from_counts(vocab: int, ids: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(ids), minlength=vocab).float()
