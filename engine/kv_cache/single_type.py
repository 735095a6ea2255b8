"""One KV-cache group's blocks per request: full attention or a sliding window.

Each group keeps `req_to_blocks[req_id]`, the request's blocks in token order: token t
lives in block `req_to_blocks[req_id][t // block_size]`. Every group's list of a request
has the same length (one entry per block of its sequence so far), so new blocks are
appended to every group at once. A sliding-window group replaces the blocks no query can
see any more by `null_block` (never in the pool; its id is the cache's padding block,
which the attention kernels never read for a windowed layer) and frees them: cached ones
stay in the free queue as prefix-cache candidates until evicted.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache.block import KVCacheBlock
from engine.kv_cache.block_hash import BlockHash
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.groups import CacheKey, group_block_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FullAttentionBlocks:
    """A full-attention group: a request keeps every block of its sequence."""

    sliding_window: int | None = None

    def __init__(self, pool: BlockPool, block_size: int, group_id: int, null_block: KVCacheBlock):
        self.pool = pool
        self.block_size = block_size
        self.group_id = group_id
        self.null_block = null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks already carry their hash.
        self.num_cached_blocks: dict[str, int] = {}

    def cache_key(self, block_hash: BlockHash) -> CacheKey:
        return group_block_hash(block_hash, self.group_id)

    def cached(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.pool.get_cached_block(self.cache_key(block_hash))

    def find_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                 ) -> list[KVCacheBlock]:
        """The longest prefix of `block_hashes[:max_num_blocks]` cached in this group:
        every block up to it (a broken chain: no later block can match)."""
        hit = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = self.cached(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Free the blocks no later query of `req_id` reads (none, with full attention)."""

    def tokens_until_skip(self, req_id: str) -> int | None:
        """Computed tokens at which `remove_skipped_blocks` would next free a block."""
        return None

    def num_held(self, req_id: str) -> int:
        """Blocks `req_id` holds in this group (null entries not counted)."""
        return len(self.req_to_blocks.get(req_id, ()))

    def cache_full_blocks(self, req_id: str, block_hashes: Sequence[BlockHash],
                          num_full_blocks: int) -> list[int]:
        """Hash the request's blocks [already hashed, num_full_blocks); returns the
        indices that became new cache entries (BlockPool.cache_full_blocks)."""
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full_blocks <= num_cached:
            return []
        blocks = self.req_to_blocks[req_id]
        if self.group_id == 0:
            hashes = block_hashes
        else:
            hashes = [None] * num_cached + [self.cache_key(h) for h in
                                            block_hashes[num_cached:num_full_blocks]]
        # (The null block counts as hashed already: the pool skips it.)
        newly = self.pool.cache_full_blocks(blocks, hashes, num_cached, num_full_blocks)
        self.num_cached_blocks[req_id] = num_full_blocks
        return newly

    def free(self, req_id: str, discard_cached: bool, num_written_tokens: int | None) -> None:
        """Release every block of `req_id` (tail first: its prefix is evicted last)."""
        blocks = self.req_to_blocks.pop(req_id, [])
        self.num_cached_blocks.pop(req_id, None)
        null = self.null_block
        if discard_cached:
            self.pool.uncache_blocks(b for b in blocks if b is not null)
        elif num_written_tokens is not None:
            unwritten = blocks[num_written_tokens // self.block_size:]
            self.pool.uncache_blocks(b for b in unwritten if b is not null)
        self.pool.free_blocks(b for b in reversed(blocks) if b is not null)


class SlidingWindowBlocks(FullAttentionBlocks):
    """A sliding-window group: a request keeps only the blocks its next queries can see.

    The query at position p reads keys p - W + 1 .. p. A step computing positions from
    c on reads keys from c - W + 1 on, so blocks before (c - W + 1) // block_size are
    skipped. Example, block_size 4, W 6, 13 tokens computed:

        blocks  [b0 b1 b2 b3]     next query: position 13, keys 8..13
        ->      [null null b2 b3]  b0 and b1 freed (still cached, evictable)

    A decode therefore holds at most cdiv(W - 1, block_size) + 1 blocks, at most
    cdiv(W, block_size) + 1 of any window alignment; a prompt chunk of n tokens also
    the blocks its own earlier tokens need, until the next step frees them.
    """

    def __init__(self, pool: BlockPool, block_size: int, group_id: int,
                 null_block: KVCacheBlock, sliding_window: int):
        super().__init__(pool, block_size, group_id, null_block)
        self.sliding_window = sliding_window
        # How many leading entries of each request's list are null.
        self.num_skipped: dict[str, int] = {}
        # A prefix hit needs the blocks of the W - 1 keys before its end (the next query
        # adds its own): W 6, block 4 -> 2 blocks; W 5 -> 1 block.
        self.num_window_blocks = cdiv(sliding_window - 1, block_size)

    def find_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int
                 ) -> list[KVCacheBlock]:
        """The longest hit of at most `max_num_blocks` blocks whose last
        `num_window_blocks` blocks are cached (or all of them, for a shorter hit):
        nulls before them. Scans from the end, as the window is at the end.

        Example, num_window_blocks 2, cached = [y y n y y y] (n: not cached), max 6:
        from the right, blocks 5 and 4 are cached -> hit of 6 blocks:
        [null null null null b4 b5]. With cached = [y y n y n y]: runs of one only,
        until blocks 1, 0 -> hit of 2 blocks [b0 b1].
        """
        if self.num_window_blocks == 0:  # W = 1: a query sees only itself
            return [self.null_block] * max_num_blocks
        run: list[KVCacheBlock] = []  # cached blocks ending at the current hit end
        for index in range(max_num_blocks - 1, -1, -1):
            block = self.cached(block_hashes[index])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == self.num_window_blocks:
                return [self.null_block] * index + run[::-1]
        # No full window anywhere: a hit shorter than the window needs all its blocks,
        # which is the run that reached block 0 (empty if block 0 is not cached).
        return run[::-1]

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        num_skipped = min(max(0, num_computed_tokens - self.sliding_window + 1)
                          // self.block_size, len(blocks))
        first = self.num_skipped.get(req_id, 0)
        if num_skipped <= first:
            return
        freed = [b for b in blocks[first:num_skipped] if b is not self.null_block]
        blocks[first:num_skipped] = [self.null_block] * (num_skipped - first)
        self.num_skipped[req_id] = num_skipped
        self.pool.free_blocks(freed)

    def tokens_until_skip(self, req_id: str) -> int | None:
        # Block s (the first one held) is skipped once c - W + 1 >= (s + 1) * block_size.
        first = self.num_skipped.get(req_id, 0)
        return (first + 1) * self.block_size + self.sliding_window - 1

    def num_held(self, req_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(req_id, ()) if b is not self.null_block)

    def free(self, req_id: str, discard_cached: bool, num_written_tokens: int | None) -> None:
        super().free(req_id, discard_cached, num_written_tokens)
        self.num_skipped.pop(req_id, None)
