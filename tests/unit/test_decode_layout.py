"""A decode step's layout in one C pass equals FlatLayout.build's torch ops, and refuses what the tables lack."""
import random

import pytest
import torch

from services.model_worker.engine.block_tables import BlockTables
from services.model_worker.executor.step_inputs import TENSOR_FIELDS, StepInputs
from services.model_worker.kernels import cpu_decode_layout
from services.model_worker.model.layers.attention.metadata import FlatLayout

pytestmark = pytest.mark.skipif(cpu_decode_layout.load() is None, reason="needs a C compiler")


def random_tables(rng: random.Random, seqs: int, block_size: int, max_blocks: int):
    """Persistent tables with `seqs` sequences in scattered slots, each with a context and a table to hold it."""
    tables = BlockTables(max_seqs=seqs + 7, max_blocks_per_seq=max_blocks, block_size=block_size)
    tables.rows.random_(0, 1 << 20)  # stale entries everywhere, as rows hold once sequences come and go
    slots = rng.sample(range(seqs + 7), seqs)
    contexts = [rng.randint(1, max_blocks * block_size) for _ in range(seqs)]
    for slot, context in zip(slots, contexts):
        blocks = -(-context // block_size)
        tables.rows[slot, :blocks] = torch.tensor(rng.sample(range(5000), blocks), dtype=torch.int32)
    return tables, slots, contexts


@pytest.mark.parametrize("seqs, block_size", [(1, 16), (3, 1), (64, 16), (256, 32)])
def test_the_c_layout_equals_the_torch_layout_of_the_gathered_rows(seqs, block_size):
    rng = random.Random(seqs * 31 + block_size)
    tables, slots, contexts = random_tables(rng, seqs, block_size, max_blocks=9)
    width = -(-max(contexts) // block_size)
    table, positions, slot_mapping, context = cpu_decode_layout.decode_layout(tables.rows, slots, contexts, width,
                                                                              block_size)
    expected = FlatLayout.build([1] * seqs, tables.gather(slots, max(contexts)), contexts, block_size)
    assert torch.equal(table, expected.block_tables) and table.dtype == torch.int32
    assert torch.equal(positions, expected.positions) and positions.dtype == torch.int64
    assert torch.equal(slot_mapping, expected.slot_mapping) and slot_mapping.dtype == torch.int64
    assert torch.equal(context, expected.context_lens) and context.dtype == torch.int32
    # And from first principles: the newest token's slot is its block's id times the block size plus its offset.
    for i, (slot, n) in enumerate(zip(slots, contexts)):
        assert slot_mapping[i] == int(tables.rows[slot, (n - 1) // block_size]) * block_size + (n - 1) % block_size


def test_decode_inputs_are_the_same_with_the_kernel_or_without(monkeypatch):
    rng = random.Random(5)
    tables, slots, contexts = random_tables(rng, 40, 16, max_blocks=6)
    ids = [rng.randrange(1000) for _ in slots]
    fast = StepInputs.decode_from_tables(ids, tables, slots, contexts)
    monkeypatch.setattr(cpu_decode_layout, "load", lambda: None)
    slow = StepInputs.decode_from_tables(ids, tables, slots, contexts)
    for name in TENSOR_FIELDS:
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.max_query_len, fast.max_context_len) == (slow.max_query_len, slow.max_context_len)
    assert (fast.max_query_len, fast.max_context_len) == (1, max(contexts))


@pytest.mark.parametrize("case, status", [("row", -1), ("negative row", -1), ("empty", -2), ("too wide", -2),
                                          ("negative block", -3)])
def test_what_the_tables_do_not_hold_is_refused_before_anything_is_read(case, status):
    tables = BlockTables(max_seqs=4, max_blocks_per_seq=3, block_size=4)
    slots, contexts, width = [1], [5], 2
    if case == "row":
        slots = [4]
    elif case == "negative row":
        slots = [-1]
    elif case == "empty":
        contexts = [0]
    elif case == "too wide":
        contexts = [9]  # its third block is past the width of 2
    else:
        tables.rows[1, 1] = -7
    with pytest.raises(IndexError, match=f"status {status}"):
        cpu_decode_layout.decode_layout(tables.rows, slots, contexts, width, 4)
