"""The order waiting prompts join the batch in: shortest-first (the default) and fcfs, with a fake model."""
from __future__ import annotations

import pytest

from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.engine.block_manager import BlockManager
from services.model_worker.engine.scheduler import Scheduler
from services.model_worker.main import engine_config, parse_args
from tests.unit.test_block_manager import FakeRunner, expected_output, make_seq, two_that_preempt


def admissions(scheduler: Scheduler, runner: FakeRunner, arrivals: dict[int, list] | None = None) -> list[str]:
    """Step to the end; the request ids in the order they first joined a batch. `arrivals`: step -> sequences
    added just before it."""
    order: list[str] = []
    step = 0
    while scheduler.has_work() or any(s >= step for s in (arrivals or {})):
        for seq in (arrivals or {}).get(step, []):
            scheduler.add(seq)
        step += 1
        batch = scheduler.schedule()
        order += [seq.request_id for seq in batch.seqs if seq.request_id not in order]
        runner.run(batch)
        scheduler.finish_step(batch)
        assert step < 1000
    return order


def one_at_a_time(policy: str) -> tuple[Scheduler, FakeRunner]:
    bm = BlockManager(num_blocks=64, block_size=4)
    return Scheduler(bm, SchedulerLimits(max_num_seqs=1, max_num_batched_tokens=64, policy=policy)), FakeRunner(bm)


@pytest.mark.parametrize("policy, expected", [("shortest-first", ["b", "d", "e", "c", "a"]),
                                              ("fcfs", ["a", "b", "c", "d", "e"])])
def test_a_burst_is_admitted_shortest_first_or_in_arrival_order(policy, expected):
    scheduler, runner = one_at_a_time(policy)
    prompts = {"a": 9, "b": 3, "c": 7, "d": 3, "e": 5}  # b and d tie: arrival order between them
    seqs = {name: make_seq(list(range(1, n + 1)), max_tokens=4, name=name) for name, n in prompts.items()}
    for seq in seqs.values():
        scheduler.add(seq)
    assert admissions(scheduler, runner) == expected
    for name, seq in seqs.items():
        assert seq.output_ids == expected_output(seq.prompt_ids, 4)


def test_a_cached_prefix_does_not_count_against_a_prompt():
    scheduler, runner = one_at_a_time("shortest-first")
    shared = list(range(100, 116))                        # four full blocks
    first = make_seq(shared + [1], max_tokens=2, name="first")
    scheduler.add(first)
    assert admissions(scheduler, runner) == ["first"]     # its blocks are now in the prefix cache
    fresh = make_seq(list(range(200, 210)), max_tokens=2, name="fresh")        # 10 tokens to compute
    long_cached = make_seq(shared + [7, 8], max_tokens=2, name="long_cached")  # 18 tokens, 16 of them cached
    scheduler.add(fresh)
    scheduler.add(long_cached)
    assert admissions(scheduler, runner) == ["long_cached", "fresh"]
    assert long_cached.output_ids == expected_output(long_cached.prompt_ids, 2)


def test_a_prompt_overtaken_max_bypass_times_goes_next():
    scheduler, runner = one_at_a_time("shortest-first")
    scheduler.MAX_BYPASS = 3
    head = make_seq([1], max_tokens=3, name="head")
    long = make_seq(list(range(1, 21)), max_tokens=1, name="long")
    shorts = {step: [make_seq([step, step + 1], max_tokens=2, name=f"s{step}")] for step in range(1, 9)}
    # Short prompts keep arriving, one a step, faster than they finish: without the bound, long would wait
    # for all eight.
    order = admissions(scheduler, runner, {0: [head, long], **shorts})
    assert order[:5] == ["head", "s1", "s2", "s3", "long"], order
    assert long.num_bypassed == 3
    assert long.output_ids == expected_output(long.prompt_ids, 1)


def test_a_preempted_sequence_goes_before_a_shorter_new_prompt():
    _, scheduler, runner, old, new = two_that_preempt()
    tiny = make_seq([9], max_tokens=2, name="tiny")
    readmitted = []
    while scheduler.has_work():
        batch = scheduler.schedule()
        if scheduler.num_preemptions and tiny.status.name == "WAITING" and tiny not in scheduler.waiting:
            assert new in scheduler.waiting
            scheduler.add(tiny)                          # shorter than new (3 prompt + its output so far)
        if scheduler.num_preemptions:
            readmitted += [s.request_id for s in batch.seqs if s is not old and s.request_id not in readmitted]
        runner.run(batch)
        scheduler.finish_step(batch)
    assert new.num_preemptions == 1
    assert readmitted[:2] == ["new", "tiny"]
    for seq in (old, new, tiny):
        assert seq.output_ids == expected_output(seq.prompt_ids, seq.max_tokens)


def test_the_policy_is_checked_and_reaches_the_engine(capsys):
    with pytest.raises(ValueError, match="policy must be one of fcfs, shortest-first"):
        SchedulerLimits(policy="lifo")
    assert engine_config(parse_args([])).limits.policy == "shortest-first"
    assert engine_config(parse_args(["--scheduling-policy", "fcfs"])).limits.policy == "fcfs"
    with pytest.raises(SystemExit):
        parse_args(["--scheduling-policy", "lifo"])
    assert "--scheduling-policy" in capsys.readouterr().err
