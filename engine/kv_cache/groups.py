"""KV-cache groups: a model's attention layers grouped by kind, the way vLLM V1's hybrid
KV-cache manager groups them, so sliding-window layers hold only their window's blocks.

Every group has the same number of layers (its "slots"); all groups draw block ids from
one pool, and one block id means one block in each of `group_size` cache tensors: layer
slot s of whichever group holds the id reads and writes tensor s. A request holds one
block list per group; a full-attention group keeps all its blocks, a sliding-window
group only those covering the last W tokens (engine.kv_cache.single_type).

Worked example, Gemma-3-like: 12 layers, every 6th global (5 local : 1 global), W 512:

    kinds:   L L L L L G L L L L L G     (L: sliding window 512, G: full)
    counts:  G 2, L 10  ->  group_size = min = 2
    groups:  0 full    layers 5, 11
             1 sliding layers 0, 1       2 sliding layers 2, 3     3 sliding layers 4, 6
             4 sliding layers 7, 8       5 sliding layers 9, 10
    tensors: 2 (slot 0 serves layers 5, 0, 2, 4, 7, 9; slot 1 layers 11, 1, 3, 6, 8, 10)

A block id costs 2 layers' worth of memory instead of 12, and an 8k-token request holds
512 blocks of 16 in group 0 but only 33 (512 / 16 + 1) in each sliding group: 677 ids
instead of 512 ids of 6x the size. With one kind of layer (every Llama, Qwen, ...) there
is one group of all layers: one tensor per layer, as without groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_hash import BlockHash


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its attention kind and its layers (indices among the model's attention
    layers, in model order; the i-th of them uses cache tensor i)."""

    sliding_window: int | None  # None: full attention
    layer_indices: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "full" if self.sliding_window is None else f"sliding_window={self.sliding_window}"


def make_kv_cache_groups(windows: list[int | None]) -> list[KVCacheGroupSpec]:
    """Groups for attention layers whose sliding windows (None: full) are `windows`.

    Full-attention groups come first (group 0 is then the full one, whose block list
    covers a request's whole sequence), then sliding ones by window, each kind's layers
    in model order, `group_size` (the rarest kind's count) per group, the last group of a
    kind possibly shorter.
    """
    if not windows:
        return [KVCacheGroupSpec(None, ())]
    by_kind: dict[int | None, list[int]] = {}
    for index, window in enumerate(windows):
        by_kind.setdefault(window, []).append(index)
    if len(by_kind) == 1:
        return [KVCacheGroupSpec(windows[0], tuple(range(len(windows))))]
    group_size = min(len(layers) for layers in by_kind.values())
    kinds = sorted(by_kind, key=lambda w: (w is not None, w or 0))
    return [KVCacheGroupSpec(kind, tuple(by_kind[kind][start:start + group_size]))
            for kind in kinds for start in range(0, len(by_kind[kind]), group_size)]


def group_size_of(groups: list[KVCacheGroupSpec]) -> int:
    """Cache tensors (layer slots) the groups need: the largest group's layer count."""
    return max(len(group.layer_indices) for group in groups)


def layer_slots(groups: list[KVCacheGroupSpec], num_layers: int) -> list[tuple[int, int]]:
    """(group, tensor slot) of each attention layer, in model order."""
    slots = [(0, 0)] * num_layers
    for group_id, group in enumerate(groups):
        for slot, layer in enumerate(group.layer_indices):
            slots[layer] = (group_id, slot)
    return slots


# The key a block is cached under: group 0's plain hash, (hash, group) for the others.
CacheKey = BlockHash | tuple[BlockHash, int]


def group_block_hash(block_hash: BlockHash, group_id: int) -> CacheKey:
    """The key a group's block is cached under. Every group computes the same tokens'
    blocks, so group g > 0 pairs the hash with its id: its blocks never answer another
    group's lookup; group 0 keeps the plain hash (one-group models are unchanged, and
    the x-ray's prefix tree, which shows group 0, keeps reading bytes keys)."""
    return block_hash if group_id == 0 else (block_hash, group_id)
