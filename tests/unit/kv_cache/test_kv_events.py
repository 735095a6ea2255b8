"""KV-cache events (engine/kv_cache/events.py): what the block pool logs as blocks
become prefix-cache entries, are evicted and are all cleared, in vLLM's wire format."""

from __future__ import annotations

import msgspec

from engine.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
)
from engine.kv_cache.manager import KVCacheManager
from tests.support.kv_cache import BLOCK_SIZE, make_request


def manager_with_events(num_blocks: int) -> KVCacheManager:
    manager = KVCacheManager(num_blocks, BLOCK_SIZE)
    manager.block_pool.events = KVEventLog(BLOCK_SIZE)
    return manager


def compute(manager: KVCacheManager, request, num_tokens: int) -> None:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, num_tokens - num_hit_tokens, hits,
                                  num_hit_tokens) is not None
    request.num_computed_tokens = num_tokens


def test_full_blocks_are_stored_once_with_their_tokens_and_parent():
    manager = manager_with_events(10)
    request = make_request("a", "abcdefghij")  # 10 tokens: blocks abcd, efgh (+ ij)
    compute(manager, request, 10)
    (stored,) = manager.block_pool.events.take()
    assert stored == BlockStored(request.block_hashes[:2], None, [ord(c) for c in "abcdefgh"],
                                 BLOCK_SIZE)
    # A second request with the same prefix hits it: nothing new is stored ...
    other = make_request("b", "abcdefghXYZW")
    compute(manager, other, 12)
    # ... but its third block (XYZW) is, its parent the shared second block.
    (stored,) = manager.block_pool.events.take()
    assert stored.block_hashes == [other.block_hashes[2]]
    assert stored.parent_block_hash == request.block_hashes[1]
    assert stored.token_ids == [ord(c) for c in "XYZW"]


def test_evicted_entries_are_removed_and_a_reset_clears_all():
    manager = manager_with_events(2)
    first = make_request("a", "abcdefgh")
    compute(manager, first, 8)
    manager.free(first)
    manager.block_pool.events.take()
    second = make_request("b", "ijklmnop")  # needs both blocks: evicts a's entries
    compute(manager, second, 8)
    events = manager.block_pool.events.take()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(first.block_hashes)
    manager.free(second)
    assert manager.reset_prefix_cache()
    assert manager.block_pool.events.take() == [AllBlocksCleared()]


def test_the_wire_format_is_vllms():
    """msgspec array_like structs tagged with their class names, as vLLM encodes them."""
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored([b"h1"], None, [1, 2], 16), BlockRemoved([b"h0"]), AllBlocksCleared()])
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert decoded == [1.5, [["BlockStored", [b"h1"], None, [1, 2], 16, None, "GPU"],
                             ["BlockRemoved", [b"h0"], "GPU"], ["AllBlocksCleared"]]]
