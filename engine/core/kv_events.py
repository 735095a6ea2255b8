"""Publishing KV-cache events (engine/kv_cache/events.py) over ZeroMQ, as vLLM does.

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                         "topic": "kv-events"}'

Wire format (vLLM's ZmqEventPublisher): every engine step with events is one message
on a PUB socket at `endpoint`, three frames: the topic, the sequence number (8 bytes,
big-endian, from 0), the msgpack of a KVEventBatch (stamped with data-parallel rank 0:
one engine per server). A subscriber that missed messages asks the ROUTER socket at
`replay_endpoint` with the first sequence number it wants (8 bytes) and gets, per
buffered message still held (the last `buffer_steps`), the frames [sequence number,
payload], then [-1 as 8 signed bytes, empty] as the end marker.

The first message after start-up is an AllBlocksCleared: a subscriber that saw an
earlier process of this replica forgets its blocks. A thread does the sending: the
engine core only puts a batch on a bounded queue (`max_queue_size`); when a slow
network or subscriber fills it, new batches are dropped and counted, never waited for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from engine.config import KVEventsConfig
from engine.kv_cache.events import AllBlocksCleared, KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """The PUB and replay sockets and the thread that serves them (see the module doc)."""

    def __init__(self, config: KVEventsConfig):
        import msgspec
        import zmq

        self.config = config
        self._encode = msgspec.msgpack.Encoder().encode
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self.num_dropped = 0  # batches dropped because the queue was full
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (never blocks; a full queue drops and counts them)."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events,
                                                 data_parallel_rank=0))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (the sender is behind)",
                               self.num_dropped)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        import zmq

        topic = self.config.topic.encode()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = self._next_seq, self._encode(batch)
            self._next_seq += 1
            try:
                self._pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            except zmq.ZMQError:  # closed under us at shutdown
                return
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        identity, start = frames[0], int.from_bytes(frames[-1], "big")
        delimiter = [b""] if len(frames) > 2 else []  # a REQ client's empty frame
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([identity, *delimiter, seq.to_bytes(8, "big"),
                                             payload])
        self._replay.send_multipart([identity, *delimiter, END_OF_REPLAY, b""])
