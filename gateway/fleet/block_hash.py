"""The worker's prefix-cache block hash, computed from worker.proto's definition, to route prompts by."""
from __future__ import annotations

import hashlib
import struct


def chain_root(adapter: str = "") -> bytes:
    """The parent digest of a sequence's first block: none for the base model; for a LoRA adapter, the digest
    of "adapter:" and its name, since the adapter gives the same tokens other K/V."""
    return hashlib.sha256(b"adapter:" + adapter.encode()).digest() if adapter else b""


def prompt_block_hashes(token_ids: list[int], block_size: int, adapter: str = "") -> list[bytes]:
    """Chained hashes of the prompt's blocks a worker could serve from its cache, for the base model or
    `adapter`.

    The block holding the last prompt token is always computed again, so only the first
    (n - 1) // block_size blocks count.
    """
    hashes: list[bytes] = []
    parent = chain_root(adapter)
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        block = token_ids[start:start + block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}q", *block)).digest()
        hashes.append(parent)
    return hashes
