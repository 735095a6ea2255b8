"""A KV-event subscriber's wire types, written from vLLM's documented format (pyzmq +
msgspec, its examples/online_serving/kv_events_subscriber.py, the structs of vLLM 0.28's
distributed/kv_events.py), not from pagedserve's classes; and a replay helper.

    DECODER.decode(payload) -> KVEventBatch(ts, events, data_parallel_rank)
    replay_from(context, endpoint, 0) -> [(seq, KVEventBatch), ...] up to the -1 marker
"""

from __future__ import annotations

from typing import Any

import msgspec


# As vLLM (>= 0.28) declares them: the batch an array, each event a map tagged "type".
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def replay_from(context, endpoint: str, start_seq: int, timeout_ms: int = 5000
                ) -> list[tuple[int, KVEventBatch]]:
    """Ask the replay socket at `endpoint` for every buffered batch from `start_seq`;
    (sequence number, batch) each, in order, until the end marker (-1, empty)."""
    import zmq

    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    try:
        socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches = []
        while True:
            assert socket.poll(timeout_ms), "the replay did not end"
            frames = socket.recv_multipart()
            seq_bytes, payload = frames[-2], frames[-1]
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1 and not payload:
                return batches
            batches.append((seq, DECODER.decode(payload)))
    finally:
        socket.close(0)
