"""KV cache blocks and the doubly-linked queue of free ones."""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_cache.block_hash import BlockHash


class KVCacheBlock:
    """Metadata of one KV block; the KV tensors themselves live in the model runner.

    `ref_cnt` counts the live requests that hold the block. A block with
    `ref_cnt == 0` is in the free queue; if it still has a `block_hash` its KV is
    valid and a prefix-cache hit can take it back out of the queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted first.

    A doubly-linked list through the blocks' own `prev_free_block`/`next_free_block`
    links, between two sentinels, so a prefix-cache hit can take a block out of the
    middle in O(1):

        head <-> b7 <-> b2 <-> b9 <-> tail
        popleft() -> b7            remove(b2) -> head <-> b7 <-> b9 <-> tail
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        blocks = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            blocks.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        self._head.next_free_block = block
        assert block is not None
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"{block} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def peek_n(self, n: int) -> list[KVCacheBlock]:
        """The first `n` (or fewer) free blocks from the head, the next ones `popleft`
        would hand out, without taking them (read-only; for the engine x-ray)."""
        blocks = []
        block = self._head.next_free_block
        while len(blocks) < n and block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head to tail (for tests and invariant checks)."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
