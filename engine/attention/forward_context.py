"""The forward context: how one step's attention metadata reaches every layer.

The runner wraps each forward pass in `set_forward_context(...)`; `Attention`
layers read it with `get_forward_context()`. Models never pass metadata around.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.attention.backends.base import AttentionBackend
    from engine.attention.metadata import AttentionMetadata


@dataclass
class ForwardContext:
    """`attn_metadata` is KV group 0's; with several KV-cache groups (sliding-window
    models: engine.kv_cache.groups) `group_metadata[g]` is group g's (same queries and
    lengths, its own block table and slot mapping)."""

    attn_metadata: AttentionMetadata
    backend: AttentionBackend
    group_metadata: list[AttentionMetadata] | None = None

    def metadata_of_group(self, group: int) -> AttentionMetadata:
        if group == 0 or self.group_metadata is None:  # one group (or the profiling pass)
            return self.attn_metadata
        return self.group_metadata[group]


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata, backend: AttentionBackend,
    group_metadata: list[AttentionMetadata] | None = None,
) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attn_metadata, backend, group_metadata)
    try:
        yield _current
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside set_forward_context(): the runner sets it")
    return _current
