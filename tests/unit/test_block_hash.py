"""The gateway computes the worker's prefix-cache block hashes from worker.proto's definition alone."""
from __future__ import annotations

import hashlib
import random

from gateway.fleet.block_hash import prompt_block_hashes
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.block_manager import BlockManager, block_hash
from services.model_worker.engine.sequence import Sequence


def spec_hashes(ids: list[int], block_size: int) -> list[bytes]:
    """worker.proto's words, written out byte by byte: SHA-256 over the parent digest and int64 LE ids."""
    out, parent = [], b""
    for i in range((len(ids) - 1) // block_size):
        data = parent + b"".join(t.to_bytes(8, "little", signed=True) for t in ids[i * block_size:(i + 1) * block_size])
        parent = hashlib.sha256(data).digest()
        out.append(parent)
    return out


def computed_seq(bm: BlockManager, prompt: list[int]) -> Sequence:
    """A sequence whose prompt the worker has computed and committed to its cache."""
    seq = Sequence("r", prompt, SamplingParams(), 1, frozenset())
    bm.allocate(seq)
    seq.num_cached_tokens = len(seq)
    bm.commit(seq)
    return seq


def worker_cached_hashes(bm: BlockManager, prompt: list[int]) -> list[bytes]:
    """The hashes the worker's cache registers for a prompt it has computed, in block order."""
    seq = computed_seq(bm, prompt)
    return [bm.blocks[b].hash for b in seq.block_table if bm.blocks[b].hash is not None]


def test_known_vector():
    # One block of ids 1..4: the digest of 1,2,3,4 as int64 little-endian, and its child on 5..8.
    first = hashlib.sha256(bytes.fromhex("0100000000000000" "0200000000000000" "0300000000000000"
                                         "0400000000000000")).digest()
    assert prompt_block_hashes([1, 2, 3, 4, 9], 4) == [first]
    assert block_hash(None, (1, 2, 3, 4)) == first
    assert block_hash(first, (5, 6, 7, 8)) == prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)[1]


def test_gateway_hashes_equal_the_workers():
    rng = random.Random(0)
    for block_size in (1, 4, 16):
        for length in (1, block_size, block_size + 1, 3 * block_size, 3 * block_size + 5):
            prompt = [rng.randrange(151936) for _ in range(length)]
            bm = BlockManager(64, block_size)
            cached = worker_cached_hashes(bm, prompt)
            gateway = prompt_block_hashes(prompt, block_size)
            assert gateway == spec_hashes(prompt, block_size)
            # The worker also caches the block with the last token when it is full; the gateway leaves it out,
            # since a prompt can never reuse it.
            assert cached[:len(gateway)] == gateway
            assert len(cached) == len(prompt) // block_size


def test_cache_events_follow_store_and_evict():
    bm = BlockManager(4, 2)
    seq = computed_seq(bm, [1, 2, 3, 4, 5])
    stored = [bm.blocks[b].hash for b in seq.block_table[:2]]
    assert bm.take_events() == (stored, [])
    assert bm.take_events() == ([], [])
    bm.free_blocks(seq)  # still cached, now evictable
    assert bm.take_events() == ([], [])
    # A new prompt needing every block evicts both cached ones.
    worker_cached_hashes(bm, [9, 9, 8, 8, 7, 7, 6])
    new, evicted = bm.take_events()
    assert set(evicted) == set(stored)
    assert new == prompt_block_hashes([9, 9, 8, 8, 7, 7, 6], 2)
