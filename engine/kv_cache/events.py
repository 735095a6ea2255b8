"""KV-cache events in vLLM's wire format: what routers (vllm-router's kv_aware policy,
llm-d, Dynamo) read to know which prompt blocks each replica holds.

    BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)
        blocks became prefix-cache entries (consecutive: each one's parent is the one
        before it; the first one's is `parent_block_hash`, None at a prompt's start)
    BlockRemoved(block_hashes, medium)      entries evicted (their blocks reused)
    AllBlocksCleared()                      every entry forgotten (reset, or a start)
    KVEventBatch(ts, events)                one engine step's events, as msgpack

The structs are msgspec's `array_like` with the class name as tag, as vLLM encodes them
(`["BlockStored", [hash, ...], parent, [tokens], 16, None, "GPU"]`). The hashes are
this engine's block hashes (32-byte SHA-256 digests of the parent hash, the block's
tokens and extra keys: engine/kv_cache/block_hash.py); a subscriber matches prompts by
`token_ids` and uses the hashes to pair removals with what was stored.

`KVEventLog` collects them as the block pool changes (group 0 only: with sliding-window
groups, the full-attention group's blocks stand for the prompt); the engine core takes
them once per step and publishes them (engine/core/kv_events.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM = "GPU"  # vLLM's name for the device KV cache (its CPU offload tier is "CPU")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change of the prefix cache; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = MEDIUM


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
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hashes: list[bytes], parent: bytes | None,
               token_ids: list[int]) -> None:
        self._events.append(BlockStored(list(block_hashes), parent, list(token_ids),
                                        self.block_size))

    def removed(self, block_hash: bytes) -> None:
        if self._events and isinstance(self._events[-1], BlockRemoved):
            self._events[-1].block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events
