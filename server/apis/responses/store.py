"""The Responses API's store: responses kept for GET /v1/responses/{id} and for
`previous_response_id`, in memory, bounded in count (--responses-store-size, the oldest
goes first) and age (--responses-store-ttl). Per API server process: with
--api-server-count > 1 a response is found only by the process that created it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    # The conversation so far as chat messages (input and output; no instructions), for
    # a later request's previous_response_id.
    messages: list[dict[str, Any]]
    expires_at: float


class ResponseStore:
    def __init__(self, max_size: int, ttl_s: float, clock=time.monotonic):
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, response: dict[str, Any],
            messages: list[dict[str, Any]]) -> None:
        if self.max_size <= 0:
            return
        self._items[response_id] = StoredResponse(response, messages,
                                                  self._clock() + self.ttl_s)
        self._items.move_to_end(response_id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when it was never stored, was deleted, evicted
        or has expired."""
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        now = self._clock()
        while self._items:  # oldest first: insertion order is expiry order
            response_id, item = next(iter(self._items.items()))
            if item.expires_at > now:
                return
            del self._items[response_id]
