"""Block allocation for the paged KV cache, with reference counts and prefix caching."""
from __future__ import annotations

from collections import OrderedDict

from services.model_worker.sequence import Sequence


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Chain hash of a full block: equal hashes mean equal prefixes (tokens are still checked on a hit)."""
    return hash((parent, token_ids))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out blocks to sequences.

    A full block whose K/V have been computed is registered under the hash of (its parent's
    hash, its tokens), so a later sequence with the same prefix reuses it instead of
    recomputing it. A block nobody holds keeps its contents and hash while it sits in the
    free list; free blocks are reused least recently freed first, which evicts the coldest
    cached prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0     # of which found in the cache

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

    def _take_free(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the cached prefix it held
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def _share(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free[block.block_id]
        block.ref_count += 1

    def _lookup(self, parent: int | None, tokens: tuple[int, ...]) -> tuple[int, Block | None]:
        h = block_hash(parent, tokens)
        block_id = self.cached.get(h)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return h, None
        return h, self.blocks[block_id]

    def can_allocate(self, seq: Sequence, reserve: int = 0) -> bool:
        # Conservative: prefix hits on blocks others hold would need fewer free blocks.
        return self.blocks_needed(len(seq)) + reserve <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached full blocks of its prefix."""
        assert not seq.block_table
        tokens = seq.token_ids
        parent: int | None = None
        hitting = self.enable_prefix_caching
        for i in range(self.blocks_needed(len(tokens))):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            # The last token is always computed: its logits give the next token.
            if hitting and (i + 1) * self.block_size < len(tokens):
                parent, block = self._lookup(parent, chunk)
                if block is not None:
                    self._share(block)
                    seq.block_table.append(block.block_id)
                    seq.num_cached_tokens += self.block_size
                    continue
            hitting = False
            seq.block_table.append(self._take_free().block_id)
        seq.num_hashed_blocks = seq.num_cached_tokens // self.block_size
        self.prefix_queries += len(tokens)
        self.prefix_hits += seq.num_cached_tokens

    def can_grow(self, seq: Sequence) -> bool:
        """Whether blocks for all the sequence's tokens (its newest included) fit in its own plus the free ones."""
        return self.blocks_needed(len(seq)) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence) -> None:
        """Give the sequence blocks for all its tokens: a new one each time it crosses a block boundary."""
        while self.blocks_needed(len(seq)) > len(seq.block_table):
            seq.block_table.append(self._take_free().block_id)

    def commit(self, seq: Sequence) -> None:
        """Register the sequence's full blocks whose K/V are now computed, for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_cached_tokens, len(seq)) // self.block_size
        tokens = seq.token_ids
        for i in range(seq.num_hashed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                parent = self.blocks[seq.block_table[i - 1]].hash if i else None
                chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
                block.hash, block.token_ids = block_hash(parent, chunk), chunk
                self.cached.setdefault(block.hash, block.block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def free_blocks(self, seq: Sequence) -> None:
        # Release the tail first: it goes to the LRU end earlier, so it is evicted before the shared prefix.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_hashed_blocks = 0
