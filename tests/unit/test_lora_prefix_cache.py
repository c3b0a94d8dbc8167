"""Prefix-cache keys of LoRA sequences (worker.proto, LoadUpdate): a chain rooted at the adapter's name, so a base
request and an adapter request with the same tokens never share blocks, and requests of one adapter do."""
from __future__ import annotations

import hashlib
import struct

from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.block_manager import BlockManager, adapter_root
from services.model_worker.engine.sequence import Sequence

BLOCK = 4
TOKENS = list(range(100, 113))  # three full blocks and one token


def sequence(name: str, adapter: str = "") -> Sequence:
    seq = Sequence(name, TOKENS, SamplingParams(), 4, frozenset())
    if adapter:
        seq.adapter, seq.lora_slot, seq.hash_root = adapter, 0, adapter_root(adapter)
    return seq


def computed(manager: BlockManager, seq: Sequence) -> None:
    """Allocate the sequence and take its prompt as computed, registering its full blocks."""
    manager.allocate(seq)
    seq.num_cached_tokens = len(seq.token_ids)
    manager.commit(seq)


def spec_hashes(tokens: list[int], adapter: str) -> list[bytes]:
    """The proto's rule, written out from its text."""
    parent = hashlib.sha256(b"adapter:" + adapter.encode()).digest() if adapter else b""
    hashes = []
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(parent + b"".join(struct.pack("<q", t) for t in tokens[i * BLOCK:(i + 1) * BLOCK]))
        parent = parent.digest()
        hashes.append(parent)
    return hashes


def test_hashes_follow_the_proto_rule():
    manager = BlockManager(32, BLOCK)
    for adapter in ("", "sql-lora", "ünïcode"):
        seq = sequence(f"s-{adapter}", adapter)
        computed(manager, seq)
        assert seq.block_hashes == spec_hashes(TOKENS, adapter)
        stored, _ = manager.take_events()
        assert stored == spec_hashes(TOKENS, adapter)  # what WatchLoad reports


def test_base_and_adapter_never_share_blocks_and_one_adapter_does():
    manager = BlockManager(32, BLOCK)
    computed(manager, sequence("base"))
    assert manager.num_prefix_hit_tokens(sequence("a1", "a")) == 0
    computed(manager, sequence("a1", "a"))
    assert manager.num_prefix_hit_tokens(sequence("a2", "a")) == 3 * BLOCK
    assert manager.num_prefix_hit_tokens(sequence("b1", "b")) == 0
    assert manager.num_prefix_hit_tokens(sequence("base2")) == 3 * BLOCK


def test_an_unloaded_adapters_blocks_are_forgotten():
    manager = BlockManager(32, BLOCK)
    first = sequence("a1", "a")
    computed(manager, first)
    computed(manager, sequence("base"))
    manager.free_blocks(first)
    manager.take_events()
    manager.forget_adapter(adapter_root("a"))
    assert manager.num_prefix_hit_tokens(sequence("a2", "a")) == 0
    assert manager.num_prefix_hit_tokens(sequence("base2")) == 3 * BLOCK
    _, evicted = manager.take_events()
    assert evicted == spec_hashes(TOKENS, "a")
