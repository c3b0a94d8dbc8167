"""The block manager and scheduler without a model: block accounting, prefix caching, eviction, preemption."""
from __future__ import annotations

import random

import pytest

from rpcserver.errors import ResourceExhausted
from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine import block_manager as block_manager_module
from services.model_worker.engine.block_manager import BlockManager
from services.model_worker.engine.scheduler import ScheduledBatch, Scheduler
from services.model_worker.engine.sequence import Sequence, SequenceStatus


def make_seq(prompt: list[int], max_tokens: int = 8, name: str | None = None) -> Sequence:
    return Sequence(name or f"r{random.random()}", prompt, SamplingParams(), max_tokens, frozenset())


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Pretend the model has written K/V for the sequence's first num_tokens tokens (all by default)."""
    seq.num_cached_tokens = len(seq) if num_tokens is None else num_tokens
    bm.commit(seq)


def check_ref_counts(bm: BlockManager, live: list[Sequence]) -> None:
    """Each block is held once per live sequence whose table names it; exactly the unheld ones are free."""
    held = [0] * bm.num_blocks
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table)
        for block_id in seq.block_table:
            held[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == held
    assert set(bm.free) == {i for i, n in enumerate(held) if n == 0}
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h
    # Exactly the free blocks holding no cached prefix may be placed in new runs.
    assert [bool(x) for x in bm.spare] == [b.ref_count == 0 and not bm._is_cached(b) for b in bm.blocks]


# -- allocation ---------------------------------------------------------------------------------------


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and bm.num_free == 5 and bm.num_used == 3
    assert seq.num_cached_tokens == 0

    seq.append(10), seq.append(11)        # 12 tokens: still 3 blocks
    assert bm.can_grow(seq)
    bm.grow(seq)
    assert len(seq.block_table) == 3
    seq.append(12)                        # 13th token crosses into a 4th block
    bm.grow(seq)
    assert len(seq.block_table) == 4 and bm.num_free == 4
    check_ref_counts(bm, [seq])

    bm.free_blocks(seq)
    assert seq.block_table == [] and seq.num_cached_tokens == 0
    assert bm.num_free == 8
    check_ref_counts(bm, [])


def test_can_allocate_counts_the_reserve_and_can_grow_the_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(list(range(12)))       # 3 blocks
    assert bm.can_allocate(seq, reserve=1)
    assert not bm.can_allocate(seq, reserve=2)
    bm.allocate(seq)
    for t in range(4):
        seq.append(100 + t)               # 16 tokens: fits the 4th block
    assert bm.can_grow(seq)
    bm.grow(seq)
    seq.append(200)                       # 17 tokens need a 5th block, which does not exist
    assert not bm.can_grow(seq)


# -- prefix caching -----------------------------------------------------------------------------------


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(13)))     # 3 full blocks + 1 token
    bm.allocate(first)
    computed(bm, first)
    second = make_seq(list(range(12)) + [99, 98])
    bm.allocate(second)
    assert second.num_cached_tokens == 12
    assert second.block_table[:3] == first.block_table[:3]
    assert second.block_table[3] != first.block_table[3]
    assert [bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 2, 1]
    check_ref_counts(bm, [first, second])
    assert bm.hit_rate == pytest.approx(12 / (13 + 14))

    bm.free_blocks(first)                 # the shared blocks stay with the second sequence
    assert [bm.blocks[b].ref_count for b in second.block_table] == [1, 1, 1, 1]
    check_ref_counts(bm, [second])
    bm.free_blocks(second)
    check_ref_counts(bm, [])


def test_miss_after_a_differing_block_even_if_later_blocks_match():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(17)))
    bm.allocate(first)
    computed(bm, first)
    changed = list(range(17))
    changed[5] = 500                      # differs in the second block only
    second = make_seq(changed)
    bm.allocate(second)
    # Blocks 3 and 4 hold the same tokens as the first sequence's, but after a different prefix.
    assert second.num_cached_tokens == 4
    assert second.block_table[0] == first.block_table[0]
    assert not set(second.block_table[1:]) & set(first.block_table)


def test_last_prompt_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(12)))
    bm.allocate(first)
    computed(bm, first)
    assert len(bm.cached) == 3
    same = make_seq(list(range(12)))      # every block cached, but its last token's logits are needed
    bm.allocate(same)
    assert same.num_cached_tokens == 8
    assert same.num_uncached_tokens == 4
    assert same.block_table[2] != first.block_table[2]
    one_more = make_seq(list(range(13)))
    bm.allocate(one_more)
    assert one_more.num_cached_tokens == 12


def test_only_computed_blocks_are_served():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(17)))
    bm.allocate(first)
    assert make_hits(bm, list(range(17))) == 0   # allocated, nothing computed yet
    computed(bm, first, num_tokens=6)             # a prefill chunk that ends mid-block
    assert make_hits(bm, list(range(17))) == 4
    computed(bm, first, num_tokens=17)
    assert make_hits(bm, list(range(17))) == 16


def make_hits(bm: BlockManager, prompt: list[int]) -> int:
    seq = make_seq(prompt)
    bm.allocate(seq)
    hits = seq.num_cached_tokens
    bm.free_blocks(seq)
    return hits


def test_equal_hashes_with_different_tokens_are_a_miss(monkeypatch):
    monkeypatch.setattr(block_manager_module, "block_hash", lambda parent, tokens: b"collision")
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(9)))
    bm.allocate(first)
    computed(bm, first)
    other = make_seq([7, 7, 7, 7, 7, 7, 7, 7, 7])
    bm.allocate(other)
    assert other.num_cached_tokens == 0
    assert not set(other.block_table) & set(first.block_table)
    # The same tokens still hit: the token check, not the hash, rejected the other prompt.
    assert make_hits(bm, list(range(9))) == 4


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = make_seq(list(range(13)))
    bm.allocate(first)
    computed(bm, first)
    assert not bm.cached
    assert make_hits(bm, list(range(13))) == 0
    assert bm.hit_rate == 0.0


def test_hits_on_held_blocks_need_no_free_blocks():
    bm = BlockManager(num_blocks=5, block_size=4)
    first = make_seq(list(range(13)))     # 4 blocks, 3 of them full
    bm.allocate(first)
    computed(bm, first)
    assert bm.num_free == 1
    # Three of the second's four blocks are held by the first already: it needs one free block.
    second = make_seq(list(range(13)))
    assert bm.can_allocate(second)
    assert not bm.can_allocate(second, reserve=1)
    bm.allocate(second)
    assert bm.num_free == 0 and second.num_cached_tokens == 12
    check_ref_counts(bm, [first, second])
    bm.free_blocks(first)
    bm.free_blocks(second)
    # Hits on free cached blocks still take them out of the free list.
    third = make_seq(list(range(13)))
    assert bm.can_allocate(third, reserve=1) and not bm.can_allocate(third, reserve=2)


def cached_prefix(bm: BlockManager, prompt: list[int]) -> int:
    """Prompt tokens a new sequence would find in the cache, looked up without taking any block."""
    return len(bm._prefix_hits(make_seq(prompt))) * bm.block_size


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = list(range(8)), list(range(100, 108))  # 2 full blocks each
    for prompt in (a, b):
        seq = make_seq(prompt + [1000])           # plus a third block that is never full
        bm.allocate(seq)
        computed(bm, seq)
        bm.free_blocks(seq)
    assert len(bm.cached) == 4
    # Free: 6 blocks holding no prefix (4 never used, 2 partial tails), then a's (tail first), then b's.
    hog = make_seq(list(range(500, 524)))         # 6 blocks: evicts nothing
    bm.allocate(hog)
    assert (cached_prefix(bm, a + [1]), cached_prefix(bm, b + [1])) == (8, 8)
    more = make_seq(list(range(600, 604)))        # the 7th block evicts a's tail
    bm.allocate(more)
    assert (cached_prefix(bm, a + [1]), cached_prefix(bm, b + [1])) == (4, 8)

    # A hit makes a prefix recent again: a is reused and freed after b, so b goes first now.
    bm.free_blocks(hog)
    bm.free_blocks(more)
    seq = make_seq(b + [1])
    bm.allocate(seq)
    computed(bm, seq)
    bm.free_blocks(seq)
    seq = make_seq(a + [2])
    bm.allocate(seq)
    assert seq.num_cached_tokens == 4
    computed(bm, seq)                             # re-registers a's second block
    bm.free_blocks(seq)
    assert (cached_prefix(bm, a + [1]), cached_prefix(bm, b + [1])) == (8, 8)
    bm.allocate(make_seq(list(range(700, 732))))  # 8 blocks: every uncached one, then b's two
    assert (cached_prefix(bm, a + [1]), cached_prefix(bm, b + [1])) == (8, 0)


def test_shared_block_is_not_evicted_while_held():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_seq(list(range(5)))
    bm.allocate(first)
    computed(bm, first)
    second = make_seq(list(range(4)) + [9])
    bm.allocate(second)                            # shares block 0
    bm.free_blocks(first)
    hog = make_seq(list(range(300, 308)))          # takes every free block, none of them the shared one
    bm.allocate(hog)
    assert bm.num_free == 0
    assert second.block_table[0] not in hog.block_table
    check_ref_counts(bm, [second, hog])


# -- the scheduler with a fake model ------------------------------------------------------------------


def next_token(tokens: list[int]) -> int:
    """The fake model: any deterministic function of the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 2654435761) % 1000


class FakeRunner:
    """Writes each computed token to a simulated KV pool and checks every position a sequence reads."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: dict[int, tuple[int, int]] = {}   # cache slot -> (position, token) written there

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bm.block_size] * self.bm.block_size + pos % self.bm.block_size

    def run(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_cached_tokens
            assert 1 <= n and start + n <= len(seq)
            assert len(seq.block_table) * self.bm.block_size >= len(seq)
            for pos in range(start, start + n):
                self.slots[self.slot(seq, pos)] = (pos, seq.token_ids[pos])
            # Attention reads every earlier position: cached ones must hold this sequence's tokens.
            for pos in range(start + n):
                assert self.slots.get(self.slot(seq, pos)) == (pos, seq.token_ids[pos]), (seq, pos)
            if start + n == len(seq):
                seq.append(next_token(seq.token_ids))


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        assert batch, "work is waiting but nothing was scheduled"
        runner.run(batch)
        scheduler.finish_step(batch)
        steps += 1
        assert steps < max_steps
    return steps


def two_that_preempt() -> tuple[BlockManager, Scheduler, FakeRunner, Sequence, Sequence]:
    """Two waiting 3-token prompts that each decode 9 tokens, in a pool too small for both: "new" gets
    preempted."""
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64))
    old, new = make_seq([1, 2, 3], max_tokens=9, name="old"), make_seq([4, 5, 6], max_tokens=9, name="new")
    scheduler.add(old)
    scheduler.add(new)
    return bm, scheduler, FakeRunner(bm), old, new


def test_preemption_frees_the_newest_and_recomputes_it():
    bm, scheduler, runner, old, new = two_that_preempt()
    preempted_at = None
    while scheduler.has_work():
        batch = scheduler.schedule()
        if scheduler.num_preemptions and preempted_at is None:
            preempted_at = len(old)
            assert new.status == SequenceStatus.WAITING and new.block_table == [] and new.num_cached_tokens == 0
            assert scheduler.waiting[0] is new and scheduler.running == [old]
            assert new.output_ids                      # it had generated tokens: they are kept, not redrawn
        runner.run(batch)
        scheduler.finish_step(batch)
    assert preempted_at is not None
    assert old.output_ids == expected_output([1, 2, 3], 9)
    assert new.output_ids == expected_output([4, 5, 6], 9)
    assert bm.num_free == bm.num_blocks
    check_ref_counts(bm, [])


def test_sequences_decoding_together_keep_one_run_of_blocks_each():
    bm = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(bm, SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64))
    runner = FakeRunner(bm)
    for i in range(4):
        scheduler.add(make_seq([i + 1] * (3 + 5 * i), max_tokens=10 + 3 * i, name=f"s{i}"))
    grown = set()
    while scheduler.has_work():
        batch = scheduler.schedule()
        runner.run(batch)
        scheduler.finish_step(batch)
        for seq in scheduler.running:
            first = seq.block_table[0]
            assert seq.block_table == list(range(first, first + len(seq.block_table))), seq
            if len(seq.block_table) > bm.blocks_needed(len(seq.prompt_ids)):
                grown.add(seq.request_id)
        check_ref_counts(bm, scheduler.running)
    assert len(grown) == 4  # each crossed into blocks it did not start with, and stayed one run


def test_waiting_queue_limit():
    scheduler = Scheduler(BlockManager(8, 4), SchedulerLimits(max_num_seqs=1, max_num_batched_tokens=8,
                                                              max_waiting=2))
    scheduler.add(make_seq([1]))
    scheduler.add(make_seq([2]))
    with pytest.raises(ResourceExhausted):
        scheduler.add(make_seq([3]))


@pytest.mark.parametrize("fields", [dict(max_num_seqs=0), dict(max_waiting=0), dict(max_num_batched_tokens=0),
                                    dict(max_num_seqs=8, max_num_batched_tokens=4)])
def test_limits_are_checked(fields):
    with pytest.raises(ValueError):
        SchedulerLimits(**fields)


def test_chunked_prefill_and_one_token_per_step_for_every_decoding_sequence():
    bm = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(bm, SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=10))
    runner = FakeRunner(bm)
    short = make_seq([1, 2], max_tokens=20)
    scheduler.add(short)
    runner.run(batch := scheduler.schedule())
    scheduler.finish_step(batch)
    long = make_seq(list(range(30)), max_tokens=3)
    scheduler.add(long)
    chunks = []
    while not long.output_ids:
        batch = scheduler.schedule()
        assert short in batch.seqs and batch.num_tokens[batch.seqs.index(short)] == 1
        assert sum(batch.num_tokens) <= 10
        chunks.append(batch.num_tokens[batch.seqs.index(long)])
        runner.run(batch)
        scheduler.finish_step(batch)
    assert chunks == [9, 9, 9, 3]
    run_to_completion(scheduler, runner)
    assert long.output_ids == expected_output(list(range(30)), 3)
    assert short.output_ids == expected_output([1, 2], 20)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_leaves_the_pool_empty(seed):
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=rng.choice([8, 12, 24]), block_size=rng.choice([2, 4]))
    budget = rng.choice([8, 16, 64])
    scheduler = Scheduler(bm, SchedulerLimits(max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=budget,
                                              max_waiting=12))
    runner = FakeRunner(bm)
    max_len = bm.num_blocks * bm.block_size
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    live: dict[str, Sequence] = {}
    finished: list[Sequence] = []
    for step in range(300):
        action = rng.random()
        if action < 0.3 and len(scheduler.waiting) < scheduler.limits.max_waiting:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(0, 10))]
            prompt = prompt[:max_len - 1] or [1]
            seq = make_seq(prompt, max_tokens=rng.randrange(1, min(20, max_len - len(prompt)) + 1), name=f"s{step}")
            scheduler.add(seq)
            live[seq.request_id] = seq
        elif action < 0.4 and live:
            request_id = rng.choice(sorted(live))
            assert scheduler.abort(request_id) is live.pop(request_id)
        batch = scheduler.schedule()
        decoding = [s for s in scheduler.running if s.num_uncached_tokens == 1]
        assert all(s in batch.seqs for s in decoding)
        assert sum(batch.num_tokens) <= budget and len(scheduler.running) <= scheduler.limits.max_num_seqs
        if batch:
            runner.run(batch)
        scheduler.finish_step(batch)
        for seq in batch.seqs:
            if seq.is_finished:
                finished.append(live.pop(seq.request_id))
        check_ref_counts(bm, scheduler.running)
        assert all(not s.block_table for s in scheduler.waiting)
    run_to_completion(scheduler, runner)
    finished += live.values()
    for seq in finished:
        assert seq.output_ids == expected_output(seq.prompt_ids, seq.max_tokens)
    assert bm.num_free == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert len(finished) > 10
    assert bm.prefix_hits > 0
