"""A decode step's host work per sequence stays flat: the block manager is asked for blocks only at block
boundaries, block tables are written only where they change, and the persistent table rows always equal the
sequences' own tables."""
from __future__ import annotations

import random

import pytest

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.block_manager import BlockManager
from services.model_worker.engine.block_tables import BlockTables
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

BLOCK = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-host-work")
    make_checkpoint(path, eos_token_id=())
    return path


def counting(monkeypatch, cls, names: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(cls, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    return counts


def check_rows(engine: LLMEngine) -> None:
    rows = engine.block_manager.tables.rows
    for seq in engine.scheduler.running:
        table = seq.block_table
        assert rows[seq.slot, :len(table)].tolist() == table, seq


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_block_manager_work_is_per_block_not_per_step(checkpoint, monkeypatch, async_scheduling):
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="float32", block_size=BLOCK, num_blocks=512,
                                                async_scheduling=async_scheduling,
                                                limits=SchedulerLimits(max_num_seqs=32, max_num_batched_tokens=512)))
    rng = random.Random(0)
    seqs, steps = 32, 24
    for i in range(seqs):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 12))]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True))
    engine.step()  # every prompt's prefill
    check_rows(engine)
    counts = counting(monkeypatch, BlockManager, ["grow", "can_grow", "commit"])
    writes = counting(monkeypatch, BlockTables, ["write"])
    for _ in range(steps):
        engine.step()
        check_rows(engine)
    # In 24 steps of 8-token blocks a sequence crosses at most 4 boundaries: a call per crossing at most,
    # where a call per sequence per step would be 32 * 24 = 768.
    crossings = seqs * (-(-steps // BLOCK) + 1)
    assert counts["grow"] <= crossings and counts["can_grow"] <= crossings, counts
    assert counts["commit"] <= crossings, counts
    assert writes["write"] == counts["grow"], (writes, counts)


def test_rows_follow_preemption_trims_and_reuse():
    """Slots are handed back and reused; a row rewritten after a table shrinks (proposals trimmed) or is freed."""
    manager = BlockManager(num_blocks=32, block_size=4, max_seqs=2, max_blocks_per_seq=8)
    from services.model_worker.engine.sequence import Sequence
    a = Sequence("a", list(range(1, 10)), SamplingParams(max_tokens=8), 8, frozenset())
    b = Sequence("b", list(range(20, 26)), SamplingParams(max_tokens=8), 8, frozenset())
    manager.allocate(a)
    manager.allocate(b)
    assert {a.slot, b.slot} == {0, 1}
    manager.grow(a, 6)  # room for proposals past its end
    assert manager.tables.rows[a.slot, :len(a.block_table)].tolist() == a.block_table
    a.num_cached_tokens = 9
    manager.trim(a)
    manager.grow(a, 3)
    assert manager.tables.rows[a.slot, :len(a.block_table)].tolist() == a.block_table
    slot = a.slot
    manager.free_blocks(a)
    assert a.slot == -1
    c = Sequence("c", list(range(40, 45)), SamplingParams(max_tokens=8), 8, frozenset())
    manager.allocate(c)
    assert c.slot == slot
    assert manager.tables.rows[c.slot, :len(c.block_table)].tolist() == c.block_table



def test_writes_wait_for_the_next_read_and_the_last_write_to_a_place_wins():
    """Rows are written when next read: a slot freed and reused before then shows its new sequence's blocks."""
    from types import SimpleNamespace

    tables = BlockTables(max_seqs=2, max_blocks_per_seq=8, block_size=4)
    first = SimpleNamespace(block_table=[5, 6, 7])
    tables.assign(first)
    tables.write(first)
    slot = first.slot
    tables.release(first)
    second = SimpleNamespace(block_table=[9])
    tables.assign(second)
    tables.write(second)
    assert second.slot == slot
    # Its one block over the first's, and the first's others left as stale entries past its table.
    assert tables.rows[slot, :3].tolist() == [9, 6, 7]
    second.block_table += [10, 11]
    tables.write(second)
    second.block_table.append(12)
    tables.write(second)
    assert tables.rows[slot, :4].tolist() == [9, 10, 11, 12]
    assert tables.gather([slot], 16).tolist() == [[9, 10, 11, 12]]
