"""The forward context: how one step's attention metadata reaches every layer.

The runner wraps each forward pass in `set_forward_context(...)`; `Attention`
layers read it with `get_forward_context()`. Models never pass metadata around.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.attention.backends.base import AttentionBackend
    from engine.attention.metadata import AttentionMetadata


@dataclass
class LoRAMapping:
    """One step's tokens by adapter: (lora_id, token indices), the indices None when the
    adapter has every token of the step. Tokens of the base appear in no group.
    Example: tokens of requests [base, a=3, a=3, b=5] -> [(3, [1, 2]), (5, [3])]."""

    groups: list[tuple[int, torch.Tensor | None]]
    # The groups flattened for the Triton kernels, built by the first linear that needs
    # them in the step (engine/lora/layers.py flat_groups).
    flat: object | None = field(default=None, repr=False, compare=False)


@dataclass
class ForwardContext:
    """`attn_metadata` is KV group 0's; with several KV-cache groups (sliding-window
    models: engine.kv_cache.groups) `group_metadata[g]` is group g's (same queries and
    lengths, its own block table and slot mapping). `lora`: which tokens run under
    which LoRA adapter (engine/lora/layers.py); None when every token is the base's."""

    attn_metadata: AttentionMetadata
    backend: AttentionBackend
    group_metadata: list[AttentionMetadata] | None = None
    lora: LoRAMapping | None = None

    def metadata_of_group(self, group: int) -> AttentionMetadata:
        if group == 0 or self.group_metadata is None:  # one group (or the profiling pass)
            return self.attn_metadata
        return self.group_metadata[group]


_current: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata, backend: AttentionBackend,
    group_metadata: list[AttentionMetadata] | None = None,
    lora: LoRAMapping | None = None,
) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ForwardContext(attn_metadata, backend, group_metadata, lora)
    try:
        yield _current
    finally:
        _current = previous


def current_lora_mapping() -> LoRAMapping | None:
    """The running step's adapters (None: none, or no step is running)."""
    return None if _current is None else _current.lora


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("attention ran outside set_forward_context(): the runner sets it")
    return _current
