"""The Responses API's store: bounded in count (oldest out) and in age (TTL)."""

from __future__ import annotations

from server.apis.responses.store import ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_oldest_goes_first_when_full():
    store = ResponseStore(max_size=2, ttl_s=100, clock=Clock())
    for name in ("a", "b", "c"):
        store.put(name, {"id": name}, [{"role": "user", "content": name}])
    assert store.get("a") is None
    assert [store.get(n).response["id"] for n in ("b", "c")] == ["b", "c"]
    assert len(store) == 2


def test_entries_expire_and_delete():
    clock = Clock()
    store = ResponseStore(max_size=10, ttl_s=5, clock=clock)
    store.put("a", {"id": "a"}, [])
    clock.now = 3
    store.put("b", {"id": "b"}, [])
    clock.now = 5.5
    assert store.get("a") is None and store.get("b") is not None
    assert store.delete("b") and not store.delete("b")
    assert len(store) == 0


def test_size_zero_keeps_nothing():
    store = ResponseStore(max_size=0, ttl_s=5, clock=Clock())
    store.put("a", {"id": "a"}, [])
    assert store.get("a") is None
