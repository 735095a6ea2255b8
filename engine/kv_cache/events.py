"""KV-cache events in vLLM's wire format: what routers (vllm-router's kv_aware policy,
llm-d, Dynamo) read to know which prompt blocks each replica holds.

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                lora_name, extra_keys, group_idx)
        blocks became prefix-cache entries (consecutive: each one's parent is the one
        before it; the first one's is `parent_block_hash`, None at a prompt's start)
    BlockRemoved(block_hashes, medium, group_idx)   entries evicted (their blocks reused)
    AllBlocksCleared()                      every entry forgotten (reset, or a start)
    KVEventBatch(ts, events, data_parallel_rank)    one engine step's events, as msgpack

The layout is vLLM's since 0.28 (its `distributed/kv_events.py`): the batch is a msgpack
array `[ts, [event, ...], rank]`; each event a map tagged by class name under "type":

    {"type": "BlockStored", "block_hashes": [17293822569102704640], "parent_block_hash": None,
     "token_ids": [...16 ids...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None, "group_idx": 0}

(vLLM before 0.28 sent each event as an array; subscribers written for it must update
as they must for vLLM.) A hash on the wire is what vLLM sends by default: the last 8
bytes of this engine's block hash (a 32-byte SHA-256 of the parent hash, the block's
tokens and extra keys: engine/kv_cache/block_hash.py) as an unsigned integer;
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` sends the whole digest as bytes, as vLLM does.
Subscribers match prompts by `token_ids` and use the hashes to chain blocks and to pair
removals with what was stored.

`KVEventLog` collects them as the block pool changes (group 0 only: with sliding-window
groups, the full-attention group's blocks stand for the prompt); the engine core takes
them once per step and publishes them (engine/core/kv_events.py).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from engine.lora_request import LoRARequest

MEDIUM = "GPU"  # vLLM's name for the device KV cache (its CPU offload tier is "CPU")
ExternalBlockHash = int | bytes


def wire_hash(block_hash: bytes, as_bytes: bool = False) -> ExternalBlockHash:
    """A block hash as vLLM puts it on the wire. Example: a digest ending in
    bytes 00 .. 00 01 2c -> 300; `as_bytes` (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): the digest."""
    return block_hash if as_bytes else int.from_bytes(block_hash[-8:], "big")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change of the prefix cache; a map whose "type" is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block, where hashed
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventLog:
    """The events since the last `take()`, in order; consecutive removals share one
    BlockRemoved. Example: blocks h1, h2 of a prompt cached, then h0 evicted ->
    [BlockStored([h1, h2], parent, tokens of both), BlockRemoved([h0])]."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._hashes_as_bytes = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES") == "0"
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hashes: list[bytes], parent: bytes | None, token_ids: list[int],
               extra_keys: list[tuple[Any, ...] | None] | None = None,
               lora: LoRARequest | None = None) -> None:
        """`extra_keys`: per block, what its hash covers beside the tokens (the first
        block's cache salt and adapter); None when no block has any. `lora`: the
        adapter the blocks' KV was computed under."""
        as_bytes = self._hashes_as_bytes
        self._events.append(BlockStored(
            [wire_hash(h, as_bytes) for h in block_hashes],
            None if parent is None else wire_hash(parent, as_bytes),
            list(token_ids), self.block_size, lora_id=lora and lora.lora_id, medium=MEDIUM,
            lora_name=lora and lora.name,
            extra_keys=extra_keys if extra_keys and any(extra_keys) else None, group_idx=0))

    def removed(self, block_hash: bytes) -> None:
        wired = wire_hash(block_hash, self._hashes_as_bytes)
        if self._events and isinstance(self._events[-1], BlockRemoved):
            self._events[-1].block_hashes.append(wired)
        else:
            self._events.append(BlockRemoved([wired], MEDIUM, group_idx=0))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
