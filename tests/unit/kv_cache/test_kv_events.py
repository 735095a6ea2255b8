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
    wire_hash,
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
    assert stored == BlockStored([wire_hash(h) for h in request.block_hashes[:2]], None,
                                 [ord(c) for c in "abcdefgh"], BLOCK_SIZE, lora_id=None,
                                 medium="GPU", lora_name=None, group_idx=0)
    # A second request with the same prefix hits it: nothing new is stored ...
    other = make_request("b", "abcdefghXYZW")
    compute(manager, other, 12)
    # ... but its third block (XYZW) is, its parent the shared second block.
    (stored,) = manager.block_pool.events.take()
    assert stored.block_hashes == [wire_hash(other.block_hashes[2])]
    assert stored.parent_block_hash == wire_hash(request.block_hashes[1])
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
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(
        wire_hash(h) for h in first.block_hashes)
    manager.free(second)
    assert manager.reset_prefix_cache()
    assert manager.block_pool.events.take() == [AllBlocksCleared()]


def test_a_cache_salt_is_the_first_blocks_extra_key():
    manager = manager_with_events(10)
    request = make_request("a", "abcdefgh", cache_salt="tenant-1")
    compute(manager, request, 8)
    (stored,) = manager.block_pool.events.take()
    assert stored.extra_keys == [("tenant-1",), None]


def test_wire_hashes_are_the_digests_last_8_bytes_or_the_digest(monkeypatch):
    digest = bytes(24) + (300).to_bytes(8, "big")
    assert wire_hash(digest) == 300
    assert wire_hash(digest, as_bytes=True) == digest
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    log = KVEventLog(16)  # reads the switch once
    log.removed(digest)
    assert log.take()[0].block_hashes == [digest]


def test_the_wire_format_is_vllms():
    """vLLM >= 0.28: the batch a msgpack array [ts, events, rank], each event a map
    tagged by class name under "type"; lora_id, medium and lora_name always present."""
    log = KVEventLog(16)
    log.stored([bytes(31) + b"\x07"], None, [1, 2])
    log.removed(bytes(31) + b"\x05")
    log.cleared()
    batch = KVEventBatch(ts=1.5, events=log.take(), data_parallel_rank=0)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert decoded == [1.5, [
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None,
         "token_ids": [1, 2], "block_size": 16, "lora_id": None, "medium": "GPU",
         "lora_name": None, "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"}], 0]
