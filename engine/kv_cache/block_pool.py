"""The pool of KV blocks: allocation, freeing, and the prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.kv_cache.block_hash import BlockHash
from engine.kv_cache.events import KVEventLog


class BlockPool:
    """All KV blocks, the free queue and the map `block_hash -> cached block`.

    Contract:
      * a block is in the free queue exactly when its `ref_cnt` is 0;
      * `cached_block_hash_to_block[h].block_hash == h` for every entry;
      * freed blocks go to the tail, so the least-recently-used cached block is
        evicted first when `get_new_blocks` reuses it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # --kv-events-config: removals and resets are logged here (the manager logs
        # what is stored, with the tokens the pool does not see). None: no events.
        self.events: KVEventLog | None = None

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> list[int]:
        """Give blocks `[num_cached_blocks, num_full_blocks)` their hashes and map them;
        returns the indices (into `blocks`) that became new cache entries.

        If another block already holds the same hash (two requests computed the same
        prefix at once), the map keeps the first; the duplicate stays uncached.
        """
        newly: list[int] = []
        if not self.enable_caching:
            return newly
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None:
                continue  # a prefix-cache hit: already cached
            block_hash = block_hashes[index]
            if block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            newly.append(index)
        return newly

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the head of the free queue, evicting cached ones."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.events is not None and isinstance(block.block_hash, bytes):
                self.events.removed(block.block_hash)  # group 0's keys are plain hashes
        block.block_hash = None

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Forget the hashes of `blocks`: their KV must not serve prefix hits."""
        for block in blocks:
            self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix-cache hit: take free blocks out of the queue and add a reference."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the tail in order.

        Callers pass a request's blocks in reverse, so its tail blocks (the least
        likely to be shared) are evicted before its prefix.
        """
        released = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than taken"
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks held by live requests (free cached blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
