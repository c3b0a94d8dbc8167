"""Block allocation for the paged KV cache, with reference counts and prefix caching."""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict

from services.model_worker.engine.block_tables import BlockTables
from services.model_worker.engine.sequence import Sequence


def block_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chain hash of a full block: equal hashes mean equal prefixes (tokens are still checked on a hit).

    SHA-256, not Python's hash(): hash() of ints is predictable, so a client could craft a prompt
    whose blocks collide with another client's prefix and be served (or poison) its cached K/V.
    The bytes are fixed (worker.proto, LoadUpdate): the parent's digest, then each id as a
    little-endian int64, so a gateway in any language computes the same hashes to route by.
    """
    digest = hashlib.sha256(parent or b"")
    ids = array("q", token_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    digest.update(ids.tobytes())
    return digest.digest()


SPARE, ROOM = b"\x01", b"\x02"


def adapter_root(name: str) -> bytes:
    """The digest a LoRA adapter's block hash chain starts from (worker.proto, LoadUpdate): its K/V differ from
    the base model's and every other adapter's for the same tokens, so their blocks never match."""
    return hashlib.sha256(b"adapter:" + name.encode()).digest()


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "root")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()
        self.root: bytes | None = None  # the adapter chain its hash is on (None: the base model's)


class BlockManager:
    """Hands out blocks to sequences.

    A full block whose K/V have been computed is registered under the hash of (its parent's
    hash, its tokens), so a later sequence with the same prefix reuses it instead of
    recomputing it. A block nobody holds keeps its contents and hash while it sits in the
    free list. Free blocks that hold no cached prefix are reused first, then cached ones least
    recently freed first, which evicts the coldest prefixes.

    Where the pool allows, a sequence's blocks form one run of ids with room after it for the
    rest of its tokens (max_tokens), which later steps fill: attention reads such a sequence's
    keys in place instead of gathering them. The room is only a preference; it is free for
    anyone once no run is left.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, max_seqs: int = 256,
                 max_blocks_per_seq: int | None = None):
        self.block_size = block_size
        # Running sequences' tables as tensor rows, kept in step with their lists here.
        self.tables = BlockTables(max_seqs, max_blocks_per_seq or num_blocks, block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        # Per block: SPARE (free, holds no cached prefix), ROOM (the same, kept for a sequence to grow into), or 0.
        self.spare = bytearray(SPARE * num_blocks)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0     # of which found in the cache
        # Cache changes since the last take_events(), hash -> True (stored) or False (evicted), for
        # the workers' routers; a block stored and evicted in between leaves only its last state.
        self.events: dict[bytes, bool] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free)

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self, block_id: int | None = None) -> Block:
        """A free block for one sequence: this one, else the next in eviction order."""
        if block_id is None:
            block_id, _ = self.free.popitem(last=False)
        else:
            del self.free[block_id]
        self.spare[block_id] = 0
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the cached prefix it held
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                self.events[block.hash] = False
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def _append_blocks(self, seq: Sequence, count: int) -> None:
        """Add count fresh blocks to the sequence's table, extending its run of ids where possible."""
        table = seq.block_table
        while count and table and table[-1] + 1 < self.num_blocks and self.spare[table[-1] + 1]:
            table.append(self._take(table[-1] + 1).block_id)
            count -= 1
        if not count:
            return
        # A new run, with room for every token the sequence may reach if some stretch is that long.
        future = self.blocks_needed(len(seq.prompt_ids) + seq.max_tokens) - len(table)
        for length in (future, count) if future > count else (count,):
            start = self.spare.find(SPARE * length)
            if start >= 0:
                table.extend(self._take(i).block_id for i in range(start, start + count))
                self.spare[start + count:start + length] = ROOM * (length - count)
                return
        table.extend(self._take().block_id for _ in range(count))

    def _share(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def _is_cached(self, block: Block) -> bool:
        return block.hash is not None and self.cached.get(block.hash) == block.block_id

    def _chain_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Hashes of the sequence's first num_blocks full blocks, kept on it (tokens are only ever appended)."""
        hashes, tokens, size = seq.block_hashes, seq.token_ids, self.block_size
        for i in range(len(hashes), num_blocks):
            hashes.append(block_hash(hashes[i - 1] if i else seq.hash_root, tuple(tokens[i * size:(i + 1) * size])))
        return hashes

    def _prefix_hits(self, seq: Sequence) -> list[Block]:
        """Cached blocks holding the sequence's leading full blocks, stopping at the first miss."""
        if not self.enable_prefix_caching:
            return []
        # Prompt logprobs need every prompt position's logits, which a reused block never had computed:
        # such a prompt is prefilled whole (as vLLM does), though its blocks are still offered to others.
        if seq.wants_prompt_logprobs:
            return []
        # The block with the last token is always computed: its logits give the next token.
        hashes = self._chain_hashes(seq, (len(seq) - 1) // self.block_size)
        tokens, size, hits = seq.token_ids, self.block_size, []
        for i, h in enumerate(hashes):
            block_id = self.cached.get(h)
            # Check the tokens too: a hash match alone is not proof of equal contents.
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens[i * size:(i + 1) * size]):
                break
            hits.append(self.blocks[block_id])
        return hits

    def num_prefix_hit_tokens(self, seq: Sequence) -> int:
        """Tokens of a waiting sequence that allocate() would find cached."""
        return len(self._prefix_hits(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        """Whether a waiting sequence fits with `reserve` blocks to spare; hits on blocks others hold cost nothing."""
        held = sum(1 for block in self._prefix_hits(seq) if block.ref_count > 0)
        return self.blocks_needed(len(seq)) - held + reserve <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached full blocks of its prefix."""
        assert not seq.block_table
        hits = self._prefix_hits(seq)
        for block in hits:  # before taking free blocks, which could evict a hit sitting in the free list
            self._share(block)
            seq.block_table.append(block.block_id)
        self._append_blocks(seq, self.blocks_needed(len(seq)) - len(seq.block_table))
        self.tables.assign(seq)
        self.tables.write(seq)
        seq.num_hashed_blocks = len(hits)
        seq.num_cached_tokens = len(hits) * self.block_size
        self.prefix_queries += len(seq)
        self.prefix_hits += seq.num_cached_tokens

    def can_grow(self, seq: Sequence, extra: int = 0) -> bool:
        """Whether blocks for all the sequence's tokens (its newest included), and `extra` proposed tokens after
        them, fit in its own plus the free ones."""
        return self.blocks_needed(len(seq) + extra) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, extra: int = 0) -> None:
        """Give the sequence blocks for all its tokens (and `extra` proposed ones): a new one each time it crosses
        a block boundary."""
        self._append_blocks(seq, self.blocks_needed(len(seq) + extra) - len(seq.block_table))
        self.tables.write(seq)

    def trim(self, seq: Sequence) -> None:
        """After rejected proposals: give back the blocks past those its computed tokens fill, as a plain decode
        would never have taken them. They hold no registered prefix (commit only covers computed tokens)."""
        keep = max(self.blocks_needed(seq.num_cached_tokens), 1)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, "a trimmed block is never shared or registered"
            self.free[block.block_id] = None
            self.free.move_to_end(block.block_id, last=False)
            # Right after the sequence's run it is room again (it grows back into it, free_blocks releases it).
            adjacent = seq.block_table and block.block_id == seq.block_table[-1] + 1
            self.spare[block.block_id] = ROOM[0] if adjacent else SPARE[0]
        seq.slot_blocks = min(seq.slot_blocks, len(seq.block_table))  # regrown entries are written again

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose K/V are now computed, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        # Only tokens known here: one still in flight (asynchronous scheduling) has no id to hash yet.
        full = min(seq.num_cached_tokens, len(seq.token_ids)) // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        hashes, tokens, size = self._chain_hashes(seq, full), seq.token_ids, self.block_size
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = hashes[i], tuple(tokens[i * size:(i + 1) * size])
                block.root = seq.hash_root
                if self.cached.setdefault(block.hash, block.block_id) == block.block_id:
                    self.events[block.hash] = True
        seq.num_hashed_blocks = full

    def forget_adapter(self, root: bytes) -> None:
        """Drop the cached blocks of an adapter's chain that nobody holds (it was unloaded: a later adapter of the
        same name may have other weights, so its blocks must not be found)."""
        for block in self.blocks:
            if block.root == root and block.ref_count == 0 and block.hash is not None:
                if self._is_cached(block):
                    del self.cached[block.hash]
                    self.events[block.hash] = False
                block.hash, block.token_ids, block.root = None, (), None

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """Hashes stored and evicted since the last call (a hash is in one list at most)."""
        events, self.events = self.events, {}
        stored = [h for h, is_stored in events.items() if is_stored]
        return stored, [h for h, is_stored in events.items() if not is_stored]

    def free_blocks(self, seq: Sequence) -> None:
        if seq.block_table:
            # Give back the room kept after its run.
            end = seq.block_table[-1] + 1
            while end < self.num_blocks and self.spare[end] == ROOM[0]:
                self.spare[end] = SPARE[0]
                end += 1
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                # Released tail first, so a prefix's tail is evicted before its shared head.
                self.free[block_id] = None
                if not self._is_cached(block):
                    # Nothing a later prompt could reuse: hand it out before any cached block.
                    self.free.move_to_end(block_id, last=False)
                    self.spare[block_id] = SPARE[0]
        seq.block_table = []
        self.tables.release(seq)
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0
