"""KV-cache groups: grouping layers by kind, per-group block accounting of sliding
windows, prefix hits every group serves, and the pool's totals."""

from __future__ import annotations

import pytest

from engine.kv_cache.groups import (
    KVCacheGroupSpec,
    group_size_of,
    layer_slots,
    make_kv_cache_groups,
)
from engine.kv_cache.manager import KVCacheManager, cdiv
from tests.support.kv_cache import BLOCK_SIZE, make_request


def test_groups_of_the_worked_example():
    """12 layers, every 6th global: group size 2 (the global count), globals first."""
    windows = [512 if (i + 1) % 6 else None for i in range(12)]
    groups = make_kv_cache_groups(windows)
    assert [(g.sliding_window, g.layer_indices) for g in groups] == [
        (None, (5, 11)), (512, (0, 1)), (512, (2, 3)), (512, (4, 6)), (512, (7, 8)),
        (512, (9, 10))]
    assert group_size_of(groups) == 2
    slots = layer_slots(groups, 12)
    assert slots[5] == (0, 0) and slots[11] == (0, 1) and slots[6] == (3, 1)
    # Layers sharing a slot (tensor) belong to different groups.
    for slot in (0, 1):
        owners = [group for group, s in slots if s == slot]
        assert len(owners) == len(set(owners)) == 6


def test_one_kind_is_one_group():
    assert make_kv_cache_groups([None] * 4) == [KVCacheGroupSpec(None, (0, 1, 2, 3))]
    assert make_kv_cache_groups([64] * 3) == [KVCacheGroupSpec(64, (0, 1, 2))]


def hybrid_manager(window: int, num_blocks: int = 200, num_sliding_groups: int = 2,
                   enable_caching: bool = True) -> KVCacheManager:
    groups = [KVCacheGroupSpec(None, (0,))] + [
        KVCacheGroupSpec(window, (i + 1,)) for i in range(num_sliding_groups)]
    return KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching, groups)


def held(manager: KVCacheManager, req_id: str) -> list[int]:
    return manager.num_blocks_held(req_id)


def assert_pool_accounts(manager: KVCacheManager, req_ids: list[str]) -> None:
    """Every block is either free or held by the requests (no leak, no double count)."""
    num_held = sum(sum(held(manager, r)) for r in req_ids)
    assert manager.block_pool.get_num_free_blocks() + num_held == manager.num_blocks


@pytest.mark.parametrize("window", [3, 4, 10], ids=["W<block", "W=block", "W>block"])
@pytest.mark.parametrize("chunk", [1, 8])
def test_sliding_window_request_holds_only_its_window(window, chunk):
    """A 30-token prompt prefilled `chunk` tokens a step, then 40 decodes: each sliding
    group holds at most cdiv(W, block_size) + 1 blocks at every decode step, and at most
    the window plus its chunk while prefilling; the full group holds every block."""
    manager = hybrid_manager(window)
    request = make_request("r", list(range(100, 130)))
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert num_hit_tokens == 0
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        full, *sliding = held(manager, "r")
        assert full == cdiv(request.num_computed_tokens + num_new, BLOCK_SIZE)
        assert all(n <= cdiv(window - 1 + num_new, BLOCK_SIZE) + 1 for n in sliding), sliding
        request.num_computed_tokens += num_new
        assert_pool_accounts(manager, ["r"])
    for step in range(40):
        request.append_output_token_ids(7 + step)
        assert manager.allocate_slots(request, 1) is not None
        full, *sliding = held(manager, "r")
        assert full == cdiv(request.num_computed_tokens + 1, BLOCK_SIZE)
        assert all(n <= cdiv(window, BLOCK_SIZE) + 1 for n in sliding), (step, sliding)
        request.num_computed_tokens += 1
        assert_pool_accounts(manager, ["r"])
    # The window's own blocks are the last ones of the full group's list too.
    last = manager.get_extra_group_block_ids("r")[0][-1]
    assert last != manager.null_block.block_id
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == manager.num_blocks


def test_blocks_that_slide_out_stay_cached_and_serve_a_prefix_hit():
    """W 6, block size 4: a hit of k blocks needs, in each sliding group, the
    cdiv(W - 1, 4) = 2 blocks before its end; the earlier ones are nulls. The blocks
    that slid out while `a` ran are free but cached, and serve `b`'s hit."""
    manager = hybrid_manager(6)
    prompt = list(range(200, 226))  # 26 tokens: 6 full blocks
    a = make_request("a", prompt)
    manager.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    manager.allocate_slots(a, 18)  # at 8 computed the window (keys 3..) needs blocks 0, 1
    a.num_computed_tokens = 26
    a_full = manager.get_block_ids("a")
    a_sliding = manager.get_extra_group_block_ids("a")  # all 7 blocks, before sliding
    manager.allocate_slots(a, 0)  # a later step: blocks before (26 - 5) // 4 = 5 slide out
    null = manager.null_block.block_id
    assert all(ids[:5] == [null] * 5 for ids in manager.get_extra_group_block_ids("a"))
    assert held(manager, "a") == [7, 2, 2]
    manager.free(a)

    b = make_request("b", prompt + [1, 2, 3])  # 29 tokens: up to 7 blocks, 6 cached
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 24  # 6 blocks: the last token is never a hit
    assert [blk.block_id for blk in hits] == a_full[:6]
    assert manager.allocate_slots(b, b.num_tokens - 24, hits, 24) is not None
    b_sliding = manager.get_extra_group_block_ids("b")
    for ids, a_ids in zip(b_sliding, a_sliding, strict=True):
        # Blocks 4 and 5 (keys 16..23) are the window before position 24: a's blocks.
        assert ids[:4] == [null] * 4 and ids[4:6] == a_ids[4:6]
    assert_pool_accounts(manager, ["b"])


def test_a_hit_is_only_as_long_as_every_group_serves():
    manager = hybrid_manager(6)
    prompt = list(range(300, 326))
    a = make_request("a", prompt)
    manager.allocate_slots(a, 26)
    a.num_computed_tokens = 26
    manager.free(a)
    # Evict the second sliding group's block 5: no hit of 6 blocks has its window
    # there; a hit of 5 needs blocks 3 and 4 (keys 15..19 before position 20): cached.
    group2 = manager.groups[2]
    block5 = group2.cached(a.block_hashes[5])
    manager.block_pool.uncache_blocks([block5])
    b = make_request("b", prompt + [9])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 20 and len(hits) == 5
    assert manager.allocate_slots(b, b.num_tokens - 20, hits, 20) is not None
    assert_pool_accounts(manager, ["b"])


def test_admission_counts_every_group_and_preemption_frees_them():
    """The pool must hold the new blocks of every group at once: 3 groups, a 12-token
    prompt = 3 blocks per group = 9 blocks; with 8 free nothing is taken."""
    manager = hybrid_manager(100, num_blocks=8)
    request = make_request("r", list(range(400, 412)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.block_pool.get_num_free_blocks() == 8
    assert "r" not in manager.req_to_blocks
    manager = hybrid_manager(100, num_blocks=9)
    assert manager.allocate_slots(request, 12) is not None
    assert held(manager, "r") == [3, 3, 3]
    manager.free(request, num_written_tokens=0)  # preempted before its step ran
    assert manager.block_pool.get_num_free_blocks() == 9
    assert not manager.block_pool.cached_block_hash_to_block  # nothing was written


def test_num_tokens_fit_worked_example():
    manager = KVCacheManager(100, 16, True, [KVCacheGroupSpec(None, (0,)),
                                             KVCacheGroupSpec(32, (1,)),
                                             KVCacheGroupSpec(32, (2,))])
    assert manager.num_tokens_fit(16) == (100 - 8) * 16
    assert KVCacheManager(100, 16).num_tokens_fit(16) == 1600
