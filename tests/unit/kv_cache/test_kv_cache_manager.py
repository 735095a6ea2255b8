"""Block hashing and KVCacheManager: prefix hits, allocation, freeing, stats."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_hash import get_hash_fn, hash_block_tokens
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.support.kv_cache import BLOCK_SIZE, HASHER, SHA256, make_request, tokens_of


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def free_queue_ids(manager: KVCacheManager) -> list[int]:
    return ids(manager.block_pool.free_block_queue.get_all_free_blocks())


def prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit `request` like the scheduler does and compute its whole prompt."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    new_blocks = manager.allocate_slots(
        request, request.num_tokens - num_hit_tokens, hits, num_hit_tokens
    )
    assert new_blocks is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.req_id)


# ------------------------------------------------------------------ hashing
class TestBlockHash:
    def test_hash_is_deterministic_bytes(self):
        a = hash_block_tokens(SHA256, None, [1, 2, 3, 4])
        assert isinstance(a, bytes)
        assert a == hash_block_tokens(SHA256, None, [1, 2, 3, 4])

    def test_hash_depends_on_parent_tokens_and_extra_keys(self):
        base = hash_block_tokens(SHA256, None, [1, 2, 3, 4])
        assert hash_block_tokens(SHA256, base, [1, 2, 3, 4]) != base
        assert hash_block_tokens(SHA256, None, [1, 2, 3, 5]) != base
        assert hash_block_tokens(SHA256, None, [1, 2, 3, 4], ("salt",)) != base

    def test_hash_functions(self):
        assert len(get_hash_fn("sha256")(b"x")) == 32
        assert get_hash_fn("xxhash")(b"x") != get_hash_fn("sha256")(b"x")
        with pytest.raises(ValueError):
            get_hash_fn("md5")

    def test_hash_chain_walkthrough_example(self):
        """「你喜不喜欢吃苹果」 vs 「他喜不喜欢吃苹果」: same second block, different hash."""
        ni = HASHER.new_block_hashes(tokens_of("你喜不喜欢吃苹果"), [])
        ta = HASHER.new_block_hashes(tokens_of("他喜不喜欢吃苹果"), [])
        assert tokens_of("你喜不喜欢吃苹果")[4:] == tokens_of("他喜不喜欢吃苹果")[4:]
        assert len(ni) == len(ta) == 2
        assert ni[0] != ta[0]
        assert ni[1] != ta[1]  # the parent's hash is an input: no match after a miss
        # The chain is H(parent, tokens): recompute it by hand.
        h0 = hash_block_tokens(SHA256, None, tokens_of("你喜不喜"))
        assert ni == [h0, hash_block_tokens(SHA256, h0, tokens_of("欢吃苹果"))]

    def test_partial_blocks_are_never_hashed(self):
        assert HASHER.new_block_hashes([1, 2, 3], []) == []
        assert len(HASHER.new_block_hashes(list(range(7)), [])) == 1
        assert len(HASHER.new_block_hashes(list(range(8)), [])) == 2

    def test_new_block_hashes_extends_existing(self):
        tokens = list(range(12))
        full = HASHER.new_block_hashes(tokens, [])
        assert HASHER.new_block_hashes(tokens, full[:1]) == full[1:]
        assert HASHER.new_block_hashes(tokens, full) == []

    def test_cache_salt_only_changes_the_chain_from_the_first_block(self):
        tokens = list(range(8))
        plain = HASHER.new_block_hashes(tokens, [])
        salted = HASHER.new_block_hashes(tokens, [], lambda i: ("tenant-a",) if i == 0 else None)
        other = HASHER.new_block_hashes(tokens, [], lambda i: ("tenant-b",) if i == 0 else None)
        assert plain[0] != salted[0] != other[0]
        assert salted[0] == hash_block_tokens(SHA256, None, tokens[:4], ("tenant-a",))
        # Later blocks carry no salt of their own: they differ through the chain only.
        assert salted[1] == hash_block_tokens(SHA256, salted[0], tokens[4:])


class TestRequestBlockHashes:
    def test_hashes_grow_as_blocks_fill(self):
        request = make_request("r", list(range(6)))
        assert len(request.block_hashes) == 1  # tokens 4, 5: partial, not hashed
        request.append_output_token_ids(6)
        assert len(request.block_hashes) == 1
        first = request.block_hashes[0]
        request.append_output_token_ids(7)  # block 1 is now full
        assert len(request.block_hashes) == 2
        assert request.block_hashes[0] is first  # computed once, kept
        assert request.block_hashes == HASHER.new_block_hashes(list(range(8)), [])

    def test_no_hasher_no_hashes(self):
        request = Request("r", list(range(9)), SamplingParams())
        assert request.block_hashes == []


# ------------------------------------------------------------------ manager
class TestKVCacheManager:
    def test_allocate_exact_block_ids(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        request = make_request("a", list(range(10)))
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        assert (hits, num_hit_tokens) == ([], 0)
        new_blocks = manager.allocate_slots(request, 10)
        assert ids(new_blocks) == [0, 1, 2]
        assert manager.get_block_ids("a") == [0, 1, 2]
        assert free_queue_ids(manager) == [3, 4, 5, 6, 7, 8, 9]

    def test_allocate_caches_blocks_full_after_the_step(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        request = make_request("a", list(range(10)))
        manager.allocate_slots(request, 10)
        blocks = manager.req_to_blocks["a"]
        pool = manager.block_pool
        assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
        assert pool.get_cached_block(request.block_hashes[1]) is blocks[1]
        assert blocks[2].block_hash is None  # partial
        assert manager.num_cached_blocks["a"] == 2

    def test_chunked_allocation_caches_only_completed_blocks(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        request = make_request("a", list(range(10)))
        assert ids(manager.allocate_slots(request, 6)) == [0, 1]
        assert manager.num_cached_blocks["a"] == 1
        assert manager.req_to_blocks["a"][1].block_hash is None  # half computed
        request.num_computed_tokens = 6
        assert ids(manager.allocate_slots(request, 4)) == [2]
        assert manager.num_cached_blocks["a"] == 2
        assert manager.req_to_blocks["a"][1].block_hash == request.block_hashes[1]

    def test_decode_allocates_a_block_at_the_boundary_and_caches_the_full_one(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        request = make_request("a", list(range(7)))
        prefill(manager, request)
        assert manager.get_block_ids("a") == [0, 1]
        request.append_output_token_ids(100)  # 8 tokens: block 1 full, hashed
        assert manager.allocate_slots(request, 1) == []
        assert manager.req_to_blocks["a"][1].block_hash == request.block_hashes[1]
        request.num_computed_tokens = 8
        request.append_output_token_ids(101)  # token 8 starts block 2
        assert ids(manager.allocate_slots(request, 1)) == [2]

    def test_free_returns_blocks_tail_first(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        request = make_request("a", list(range(10)))
        prefill(manager, request)
        manager.free(request)
        assert free_queue_ids(manager) == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
        assert "a" not in manager.req_to_blocks
        assert "a" not in manager.num_cached_blocks
        manager.free(request)  # safe twice
        assert manager.block_pool.get_num_free_blocks() == 10

    def test_prefix_hit_exact_blocks_and_free_queue(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        a = make_request("a", list(range(10)))
        prefill(manager, a)  # blocks [0, 1, 2]; 0 and 1 cached
        manager.free(a)  # queue: 3..9, 2, 1, 0
        b = make_request("b", list(range(8)) + [50, 51, 52])
        hits, num_hit_tokens = manager.get_computed_blocks(b)
        assert ids(hits) == [0, 1]
        assert num_hit_tokens == 8
        new_blocks = manager.allocate_slots(b, 3, hits, num_hit_tokens)
        assert ids(new_blocks) == [3]
        assert manager.get_block_ids("b") == [0, 1, 3]
        # Hits left the middle/tail of the queue; block 2 keeps its place.
        assert free_queue_ids(manager) == [4, 5, 6, 7, 8, 9, 2]
        assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1, 3)] == [1, 1, 1]

    def test_shared_prefix_reference_counts(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        a = make_request("a", list(range(9)))
        b = make_request("b", list(range(9)))
        prefill(manager, a)
        assert prefill(manager, b) == [0, 1, 3]  # hits 0, 1; new block for the last token
        pool = manager.block_pool
        assert [pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
        manager.free(a)
        assert [pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
        assert free_queue_ids(manager)[-1:] == [2]
        manager.free(b)
        assert free_queue_ids(manager) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]

    def test_walkthrough_example_no_hit_after_a_different_first_block(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        prefill(manager, make_request("ni", "你喜不喜欢吃苹果吗"))
        same = make_request("same", "你喜不喜欢吃苹果吗")
        other = make_request("ta", "他喜不喜欢吃苹果吗")
        assert manager.get_computed_blocks(same)[1] == 8
        hits, num_hit_tokens = manager.get_computed_blocks(other)
        assert (hits, num_hit_tokens) == ([], 0)

    def test_partial_shared_prefix_hits_only_matching_blocks(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        prefill(manager, make_request("apple", "你喜不喜欢吃苹果吗"))
        hits, num_hit_tokens = manager.get_computed_blocks(make_request("pear", "你喜不喜欢吃梨子吗"))
        assert ids(hits) == [0]
        assert num_hit_tokens == 4

    def test_cache_salt_separates_tenants(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        prompt = list(range(9))
        prefill(manager, make_request("a", prompt, cache_salt="tenant-a"))
        assert manager.get_computed_blocks(make_request("b", prompt, "tenant-a"))[1] == 8
        assert manager.get_computed_blocks(make_request("c", prompt, "tenant-b"))[1] == 0
        assert manager.get_computed_blocks(make_request("d", prompt))[1] == 0

    def test_unsalted_prefix_is_not_visible_to_a_salted_request(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        prompt = list(range(9))
        prefill(manager, make_request("a", prompt))
        assert manager.get_computed_blocks(make_request("b", prompt, "tenant"))[1] == 0
        assert manager.get_computed_blocks(make_request("c", prompt))[1] == 8

    def test_partial_blocks_never_hit(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        a = make_request("a", list(range(6)))
        prefill(manager, a)
        assert len(manager.block_pool.cached_block_hash_to_block) == 1
        assert manager.req_to_blocks["a"][1].block_hash is None
        # Same 6 tokens then more: only the full first block can match.
        hits, num_hit_tokens = manager.get_computed_blocks(make_request("b", list(range(12))))
        assert ids(hits) == [0] and num_hit_tokens == 4

    def test_fully_cached_prompt_leaves_its_last_token_to_compute(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        prefill(manager, make_request("a", list(range(9))))
        # 9 tokens = 2 full blocks + 1: both blocks hit, the 9th token is computed.
        assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 8

    def test_block_aligned_fully_cached_prompt_recomputes_its_last_block(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        a = make_request("a", list(range(8)))
        prefill(manager, a)
        b = make_request("b", list(range(8)))
        hits, num_hit_tokens = manager.get_computed_blocks(b)
        assert ids(hits) == [0] and num_hit_tokens == 4  # never all 8 tokens
        assert ids(manager.allocate_slots(b, 4, hits, 4)) == [2]
        # Block 2 duplicates a's block 1: the map keeps a's, block 2 stays uncached.
        assert manager.block_pool.get_cached_block(b.block_hashes[1]).block_id == 1
        assert manager.block_pool.blocks[2].block_hash is None

    def test_allocation_failure_changes_nothing(self):
        manager = KVCacheManager(4, BLOCK_SIZE)
        a = make_request("a", list(range(9)))
        prefill(manager, a)  # 3 of 4 blocks
        b = make_request("b", list(range(100, 109)))
        assert manager.allocate_slots(b, 9) is None
        assert "b" not in manager.req_to_blocks
        assert manager.block_pool.get_num_free_blocks() == 1
        assert free_queue_ids(manager) == [3]

    def test_hits_on_free_blocks_count_against_the_free_pool(self):
        manager = KVCacheManager(4, BLOCK_SIZE)
        a = make_request("a", list(range(9)))
        prefill(manager, a)
        manager.free(a)  # all 4 free; 0 and 1 cached
        pool = manager.block_pool
        # 8 cached tokens + 9 new: 2 hits (free) + 3 new blocks = 5 > 4 free.
        too_big = make_request("big", list(range(8)) + list(range(200, 209)))
        hits, num_hit_tokens = manager.get_computed_blocks(too_big)
        assert ids(hits) == [0, 1]
        assert manager.allocate_slots(too_big, 9, hits, num_hit_tokens) is None
        assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0]
        assert pool.get_num_free_blocks() == 4
        assert pool.get_cached_block(a.block_hashes[0]) is pool.blocks[0]
        # 2 hits + 2 new blocks fit exactly.
        fits = make_request("fits", list(range(8)) + list(range(300, 305)))
        hits, num_hit_tokens = manager.get_computed_blocks(fits)
        assert ids(manager.allocate_slots(fits, 5, hits, num_hit_tokens)) == [3, 2]
        assert pool.get_num_free_blocks() == 0

    def test_allocation_evicts_lru_cached_blocks_and_breaks_later_hits(self):
        manager = KVCacheManager(4, BLOCK_SIZE)
        a = make_request("a", list(range(12)))
        prefill(manager, a)  # blocks 0, 1, 2 cached
        manager.free(a)  # queue: 3, 2, 1, 0
        b = make_request("b", list(range(500, 508)))
        assert ids(manager.allocate_slots(b, 8)) == [3, 2]  # evicts a's last block
        pool = manager.block_pool
        assert pool.get_cached_block(a.block_hashes[2]) is None
        assert pool.get_cached_block(a.block_hashes[1]) is pool.blocks[1]
        hits, num_hit_tokens = manager.get_computed_blocks(make_request("c", list(range(13))))
        assert ids(hits) == [0, 1] and num_hit_tokens == 8

    def test_eviction_of_a_prefix_block_breaks_the_chain(self):
        manager = KVCacheManager(3, BLOCK_SIZE)
        a = make_request("a", list(range(12)))
        prefill(manager, a)
        manager.free(a)  # queue: 2, 1, 0
        pool = manager.block_pool
        pool.touch([pool.blocks[2], pool.blocks[1]])  # keep the tail blocks ...
        pool.get_new_blocks(1)  # ... so block 0 (the first block) is evicted
        hits, num_hit_tokens = manager.get_computed_blocks(make_request("c", list(range(13))))
        assert (hits, num_hit_tokens) == ([], 0)  # blocks 1, 2 are cached but unreachable

    def test_prompt_logprobs_skip_the_prefix_cache(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        prefill(manager, make_request("a", list(range(9))))
        request = make_request("b", list(range(9)), prompt_logprobs=1)
        assert manager.get_computed_blocks(request) == ([], 0)

    def test_caching_disabled(self):
        manager = KVCacheManager(10, BLOCK_SIZE, enable_caching=False)
        a = make_request("a", list(range(9)))
        prefill(manager, a)
        assert manager.block_pool.cached_block_hash_to_block == {}
        assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
        assert manager.take_prefix_cache_stats().queries == 0

    def test_prefix_cache_stats_count_tokens(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        prefill(manager, make_request("a", list(range(9))))  # 9 queried, 0 hit
        prefill(manager, make_request("b", list(range(11))))  # 11 queried, 8 hit
        stats = manager.take_prefix_cache_stats()
        assert (stats.num_requests, stats.queries, stats.hits) == (2, 20, 8)
        stats = manager.take_prefix_cache_stats()
        assert (stats.num_requests, stats.queries, stats.hits) == (0, 0, 0)

    def test_usage_and_reset_prefix_cache(self):
        manager = KVCacheManager(10, BLOCK_SIZE)
        a = make_request("a", list(range(9)))
        prefill(manager, a)
        assert manager.usage == pytest.approx(0.3)
        assert not manager.reset_prefix_cache()
        manager.free(a)
        assert manager.usage == 0.0
        assert manager.reset_prefix_cache()
        assert manager.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_decode_steps_inside_a_held_block_do_no_work(caching, monkeypatch):
    """Decoding token by token, allocate_slots touches the pool only when a step needs
    a new block or completes a block to hash: 12 decode steps from a 6-token prompt
    (block size 4) -> 3 new blocks and, with caching, 3 hashing calls; the blocks and
    hashes equal those of a request that allocated the same tokens in one call."""
    manager = KVCacheManager(16, BLOCK_SIZE, enable_caching=caching)
    pool = manager.block_pool
    calls = {"new": 0, "cache": 0}
    for name, key in (("get_new_blocks", "new"), ("cache_full_blocks", "cache")):
        real = getattr(pool, name)

        def counted(*args, real=real, key=key):
            calls[key] += 1
            return real(*args)

        monkeypatch.setattr(pool, name, counted)
    request = make_request("a", list(range(6)))
    prefill(manager, request)
    calls.update(new=0, cache=0)
    for step in range(12):
        request.append_output_token_ids(100 + step)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    # Tokens 6..17 computed: blocks 2, 3, 4 are new (at tokens 8, 12, 16); blocks 1,
    # 2, 3 complete (at tokens 8, 12, 16) and get hashed.
    assert calls == {"new": 3, "cache": 3 if caching else 0}
    assert len(manager.get_block_ids("a")) == 5
    if caching:
        assert [b.block_hash for b in manager.req_to_blocks["a"][:4]] == request.block_hashes
    manager.free(request)
    assert manager.allocate_slots(make_request("b", list(range(3))), 1) is not None
