"""FreeKVCacheBlockQueue and BlockPool: exact block ids and free-queue order."""

from __future__ import annotations

import pytest

from engine.kv_cache.block import FreeKVCacheBlockQueue, KVCacheBlock
from engine.kv_cache.block_pool import BlockPool


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return ids(queue.get_all_free_blocks())


def pool_queue_ids(pool: BlockPool) -> list[int]:
    return queue_ids(pool.free_block_queue)


def make_queue(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def fake_hash(i: int) -> bytes:
    return f"hash-{i}".encode()


def assert_queue_links(queue: FreeKVCacheBlockQueue) -> None:
    """Forward and backward walks agree and match num_free_blocks."""
    forward = queue.get_all_free_blocks()
    backward = []
    block = queue._tail.prev_free_block
    while block is not None and block is not queue._head:
        backward.append(block)
        block = block.prev_free_block
    assert backward[::-1] == forward
    assert len(forward) == queue.num_free_blocks


# --------------------------------------------------------------- free queue
class TestFreeKVCacheBlockQueue:
    def test_initial_order_is_block_order(self):
        _, queue = make_queue(5)
        assert queue_ids(queue) == [0, 1, 2, 3, 4]
        assert queue.num_free_blocks == 5
        assert_queue_links(queue)

    def test_empty_queue(self):
        _, queue = make_queue(0)
        assert queue.num_free_blocks == 0
        assert queue_ids(queue) == []
        with pytest.raises(ValueError):
            queue.popleft()
        assert queue.popleft_n(0) == []

    def test_popleft_takes_head_and_unlinks_it(self):
        blocks, queue = make_queue(4)
        block = queue.popleft()
        assert block is blocks[0]
        assert block.prev_free_block is None and block.next_free_block is None
        assert queue_ids(queue) == [1, 2, 3]
        assert queue.num_free_blocks == 3
        assert_queue_links(queue)

    def test_popleft_until_empty_then_error(self):
        _, queue = make_queue(2)
        assert queue.popleft().block_id == 0
        assert queue.popleft().block_id == 1
        with pytest.raises(ValueError):
            queue.popleft()
        assert queue.num_free_blocks == 0

    def test_popleft_n_takes_from_head_in_order(self):
        blocks, queue = make_queue(6)
        taken = queue.popleft_n(3)
        assert ids(taken) == [0, 1, 2]
        assert all(b.prev_free_block is None and b.next_free_block is None for b in taken)
        assert queue_ids(queue) == [3, 4, 5]
        assert queue.num_free_blocks == 3
        assert_queue_links(queue)

    def test_popleft_n_zero_and_all(self):
        _, queue = make_queue(3)
        assert queue.popleft_n(0) == []
        assert queue_ids(queue) == [0, 1, 2]
        assert ids(queue.popleft_n(3)) == [0, 1, 2]
        assert queue_ids(queue) == []
        assert queue.num_free_blocks == 0
        assert_queue_links(queue)

    def test_popleft_n_too_many_raises_and_changes_nothing(self):
        _, queue = make_queue(3)
        with pytest.raises(ValueError):
            queue.popleft_n(4)
        assert queue_ids(queue) == [0, 1, 2]
        assert queue.num_free_blocks == 3

    @pytest.mark.parametrize("victim, expected", [(0, [1, 2, 3, 4]), (2, [0, 1, 3, 4]),
                                                  (4, [0, 1, 2, 3])])
    def test_remove_head_middle_tail(self, victim, expected):
        blocks, queue = make_queue(5)
        queue.remove(blocks[victim])
        assert queue_ids(queue) == expected
        assert queue.num_free_blocks == 4
        assert blocks[victim].prev_free_block is None
        assert blocks[victim].next_free_block is None
        assert_queue_links(queue)

    def test_remove_block_not_in_queue_raises(self):
        blocks, queue = make_queue(3)
        queue.remove(blocks[1])
        with pytest.raises(ValueError):
            queue.remove(blocks[1])
        with pytest.raises(ValueError):
            queue.remove(KVCacheBlock(99))
        assert queue_ids(queue) == [0, 2]
        assert queue.num_free_blocks == 2

    def test_append_goes_to_tail(self):
        blocks, queue = make_queue(4)
        queue.remove(blocks[1])
        queue.append(blocks[1])
        assert queue_ids(queue) == [0, 2, 3, 1]
        assert queue.num_free_blocks == 4
        assert_queue_links(queue)

    def test_append_n_keeps_given_order(self):
        blocks, queue = make_queue(5)
        taken = queue.popleft_n(3)  # [0, 1, 2]
        queue.append_n(taken[::-1])
        assert queue_ids(queue) == [3, 4, 2, 1, 0]
        queue.append_n([])
        assert queue_ids(queue) == [3, 4, 2, 1, 0]
        assert queue.num_free_blocks == 5
        assert_queue_links(queue)

    def test_append_to_emptied_queue(self):
        blocks, queue = make_queue(2)
        queue.popleft_n(2)
        queue.append(blocks[1])
        queue.append(blocks[0])
        assert queue_ids(queue) == [1, 0]
        assert queue.popleft() is blocks[1]
        assert_queue_links(queue)

    def test_mixed_operations_keep_links_consistent(self):
        blocks, queue = make_queue(8)
        a = queue.popleft()  # 0
        b = queue.popleft_n(2)  # 1, 2
        queue.remove(blocks[5])
        queue.append(a)
        queue.append_n(b)
        queue.remove(blocks[3])
        assert queue_ids(queue) == [4, 6, 7, 0, 1, 2]
        assert_queue_links(queue)


# --------------------------------------------------------------- block pool
class TestBlockPool:
    def test_new_pool_is_all_free_in_id_order(self):
        pool = BlockPool(10)
        assert ids(pool.blocks) == list(range(10))
        assert pool_queue_ids(pool) == list(range(10))
        assert pool.get_num_free_blocks() == 10
        assert pool.get_usage() == 0.0
        assert pool.cached_block_hash_to_block == {}

    def test_pool_needs_a_block(self):
        with pytest.raises(ValueError):
            BlockPool(0)

    def test_allocate_then_free_reverse_order(self):
        """The issue's example: allocate 3 for A -> [0,1,2]; free A -> tail [2,1,0]."""
        pool = BlockPool(10)
        blocks_a = pool.get_new_blocks(3)
        assert ids(blocks_a) == [0, 1, 2]
        assert [b.ref_cnt for b in blocks_a] == [1, 1, 1]
        assert pool_queue_ids(pool) == [3, 4, 5, 6, 7, 8, 9]
        assert pool.get_usage() == pytest.approx(0.3)

        pool.free_blocks(reversed(blocks_a))  # what KVCacheManager.free passes
        assert [b.ref_cnt for b in blocks_a] == [0, 0, 0]
        assert pool_queue_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
        assert pool.get_num_free_blocks() == 10

    def test_next_allocation_takes_the_head(self):
        pool = BlockPool(10)
        blocks_a = pool.get_new_blocks(3)
        pool.free_blocks(reversed(blocks_a))
        assert ids(pool.get_new_blocks(2)) == [3, 4]

    def test_get_new_blocks_too_many_raises(self):
        pool = BlockPool(4)
        pool.get_new_blocks(3)
        with pytest.raises(ValueError):
            pool.get_new_blocks(2)
        assert pool.get_num_free_blocks() == 1

    def test_shared_block_stays_out_of_queue_until_last_reference(self):
        pool = BlockPool(5)
        blocks = pool.get_new_blocks(2)  # [0, 1]
        pool.touch([blocks[0]])  # a second request shares block 0
        assert blocks[0].ref_cnt == 2
        pool.free_blocks(reversed(blocks))
        assert blocks[0].ref_cnt == 1 and blocks[1].ref_cnt == 0
        assert pool_queue_ids(pool) == [2, 3, 4, 1]
        pool.free_blocks([blocks[0]])
        assert pool_queue_ids(pool) == [2, 3, 4, 1, 0]

    def test_free_more_often_than_taken_asserts(self):
        pool = BlockPool(3)
        (block,) = pool.get_new_blocks(1)
        pool.free_blocks([block])
        with pytest.raises(AssertionError):
            pool.free_blocks([block])

    def test_cache_full_blocks_maps_hashes(self):
        pool = BlockPool(10)
        blocks = pool.get_new_blocks(3)
        hashes = [fake_hash(i) for i in range(3)]
        pool.cache_full_blocks(blocks, hashes, num_cached_blocks=0, num_full_blocks=2)
        assert pool.get_cached_block(hashes[0]) is blocks[0]
        assert pool.get_cached_block(hashes[1]) is blocks[1]
        assert pool.get_cached_block(hashes[2]) is None
        assert blocks[2].block_hash is None
        # Later, the third block fills up.
        pool.cache_full_blocks(blocks, hashes, num_cached_blocks=2, num_full_blocks=3)
        assert pool.get_cached_block(hashes[2]) is blocks[2]
        assert {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()} == {
            hashes[0]: 0, hashes[1]: 1, hashes[2]: 2,
        }

    def test_cache_full_blocks_keeps_the_first_block_for_a_hash(self):
        pool = BlockPool(10)
        first = pool.get_new_blocks(1)
        second = pool.get_new_blocks(1)
        pool.cache_full_blocks(first, [fake_hash(0)], 0, 1)
        pool.cache_full_blocks(second, [fake_hash(0)], 0, 1)
        assert pool.get_cached_block(fake_hash(0)) is first[0]
        assert second[0].block_hash is None

    def test_cache_full_blocks_skips_blocks_already_cached(self):
        pool = BlockPool(10)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
        # A prefix-cache hit re-presents block 0 with its own hash: nothing changes.
        pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
        assert len(pool.cached_block_hash_to_block) == 2
        assert blocks[0].block_hash == fake_hash(0)

    def test_cache_full_blocks_is_a_no_op_without_caching(self):
        pool = BlockPool(4, enable_caching=False)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
        assert pool.cached_block_hash_to_block == {}
        assert all(b.block_hash is None for b in blocks)

    def test_cache_hit_on_free_block_removes_it_from_the_middle(self):
        pool = BlockPool(10)
        blocks_a = pool.get_new_blocks(3)
        pool.cache_full_blocks(blocks_a, [fake_hash(i) for i in range(3)], 0, 3)
        pool.free_blocks(reversed(blocks_a))
        assert pool_queue_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]

        hit = pool.get_cached_block(fake_hash(1))
        assert hit is blocks_a[1]
        pool.touch([hit])
        assert hit.ref_cnt == 1
        assert pool_queue_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 0]
        assert pool.get_num_free_blocks() == 9
        assert hit.block_hash == fake_hash(1)  # still cached while in use
        assert pool.get_cached_block(fake_hash(1)) is hit
        assert_queue_links(pool.free_block_queue)

    def test_cache_hit_on_used_block_only_adds_a_reference(self):
        pool = BlockPool(4)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
        pool.touch([blocks[0]])
        assert blocks[0].ref_cnt == 2
        assert pool_queue_ids(pool) == [2, 3]

    def test_get_new_blocks_evicts_lru_cached_block(self):
        pool = BlockPool(10)
        blocks_a = pool.get_new_blocks(3)
        hashes = [fake_hash(i) for i in range(3)]
        pool.cache_full_blocks(blocks_a, hashes, 0, 3)
        pool.free_blocks(reversed(blocks_a))  # queue: 3..9, 2, 1, 0

        # The uncached blocks at the head go first: no eviction.
        assert ids(pool.get_new_blocks(7)) == [3, 4, 5, 6, 7, 8, 9]
        assert len(pool.cached_block_hash_to_block) == 3

        # Then the least recently freed cached block: A's tail block, 2.
        (evicted,) = pool.get_new_blocks(1)
        assert evicted.block_id == 2
        assert evicted.ref_cnt == 1
        assert evicted.block_hash is None
        assert pool.get_cached_block(hashes[2]) is None
        assert pool.get_cached_block(hashes[0]) is blocks_a[0]
        assert pool.get_cached_block(hashes[1]) is blocks_a[1]
        assert pool_queue_ids(pool) == [1, 0]

    def test_touched_block_is_not_evicted(self):
        pool = BlockPool(3)
        blocks = pool.get_new_blocks(3)
        pool.cache_full_blocks(blocks, [fake_hash(i) for i in range(3)], 0, 3)
        pool.free_blocks(reversed(blocks))  # queue: 2, 1, 0
        pool.touch([pool.get_cached_block(fake_hash(2))])  # a hit on the head block
        assert ids(pool.get_new_blocks(2)) == [1, 0]
        assert pool.get_cached_block(fake_hash(2)) is blocks[2]
        assert pool.cached_block_hash_to_block.keys() == {fake_hash(2)}

    def test_reset_prefix_cache(self):
        pool = BlockPool(4)
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(blocks, [fake_hash(0), fake_hash(1)], 0, 2)
        assert not pool.reset_prefix_cache()  # blocks still held
        assert len(pool.cached_block_hash_to_block) == 2
        pool.free_blocks(reversed(blocks))
        assert pool.reset_prefix_cache()
        assert pool.cached_block_hash_to_block == {}
        assert all(b.block_hash is None for b in pool.blocks)
        assert pool.get_num_free_blocks() == 4
