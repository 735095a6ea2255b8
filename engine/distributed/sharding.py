"""Which part of each checkpoint tensor a tensor-parallel rank holds.

Every function here is pure index arithmetic over (rank, size): the layers call
them at construction to size their parameters, and again at load to slice the
checkpoint, so a rank reads only its own rows or columns.

    column-parallel (qkv_proj, gate_up_proj, lm_head):  rows of W [out, in] split
    row-parallel    (o_proj, down_proj):                columns of W split, outputs summed
    vocab-parallel  (embed_tokens):                     rows split, padded to equal shards
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RowRange:
    """Rows [start, start + size) of a checkpoint tensor (or columns, for row-parallel)."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def even_range(total: int, rank: int, size: int, what: str = "dimension") -> RowRange:
    """Rank `rank`'s equal share of `total` rows.

    Example: total 1536 (an MLP's intermediate size), size 3 -> rank 0 [0, 512),
    rank 1 [512, 1024), rank 2 [1024, 1536).
    """
    if total % size:
        raise ValueError(f"tensor parallel size {size} does not divide the {what} ({total})")
    share = total // size
    return RowRange(rank * share, share)


def padded_range(total: int, rank: int, size: int) -> tuple[RowRange, int]:
    """(the real rows rank holds, its padded shard size) for a vocabulary of `total` rows.

    Every rank holds ceil(total / size) rows so that gathered shards line up; the
    last ranks' rows past `total` are padding (zeros, cut off after the gather).
    Example: total 10, size 3 -> shard 4: rank 0 [0, 4), rank 1 [4, 8),
    rank 2 [8, 10) + 2 padding rows.
    """
    shard = -(-total // size)
    start = min(rank * shard, total)
    return RowRange(start, min(shard, total - start)), shard


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank computes, and their rows in q_proj / k_proj / v_proj."""

    num_heads: int
    num_kv_heads: int
    q_rows: RowRange
    kv_rows: RowRange  # the same rows of k_proj and of v_proj


def shard_heads(num_heads: int, num_kv_heads: int, head_size: int, rank: int,
                size: int) -> HeadShard:
    """Query heads split evenly; KV heads split too, or replicated when fewer than ranks.

    Each rank's query heads must read KV heads it holds. With grouped-query attention
    query head h reads KV head h // (num_heads / num_kv_heads).

    Example, 8 query heads, 2 KV heads (groups of 4), head_size 16:
      size 2: rank 0 q heads 0-3 + KV head 0, rank 1 q heads 4-7 + KV head 1;
              rank 1's q rows [64, 128), KV rows [16, 32).
      size 4: rank 0 q heads 0-1, rank 1 q heads 2-3 -> both KV head 0 (replicated);
              ranks 2, 3 -> KV head 1. KV head of rank r = r // (size / num_kv_heads).
    """
    if num_heads % size:
        raise ValueError(f"tensor parallel size {size} does not divide the number of "
                         f"attention heads ({num_heads})")
    heads = num_heads // size
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"tensor parallel size {size} does not divide the number of "
                             f"KV heads ({num_kv_heads})")
        kv_heads, first_kv = num_kv_heads // size, rank * (num_kv_heads // size)
    else:
        if size % num_kv_heads:
            raise ValueError(f"the {num_kv_heads} KV heads cannot be replicated evenly over "
                             f"tensor parallel size {size}")
        kv_heads, first_kv = 1, rank // (size // num_kv_heads)
    return HeadShard(heads, kv_heads, RowRange(rank * heads * head_size, heads * head_size),
                     RowRange(first_kv * head_size, kv_heads * head_size))


def check_tensor_parallel(hf_config: Any, size: int) -> None:
    """Raise ValueError (one line naming the model's numbers and the sizes that would
    work) if `size` ranks cannot split this model; called once at start-up, before any
    worker starts."""
    if size == 1:
        return
    hf_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") \
        else hf_config
    try:
        _check_sizes(hf_config, size)
    except ValueError as exc:
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        valid = [n for n in range(1, 9) if _fits(hf_config, n)]
        raise ValueError(
            f"--tensor-parallel-size {size}: {exc}; the model has {num_heads} attention "
            f"heads and {num_kv_heads} KV heads (sizes up to 8 that fit: "
            f"{', '.join(map(str, valid))})") from None


def _check_sizes(hf_config: Any, size: int) -> None:
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    shard_heads(num_heads, num_kv_heads, 1, 0, size)
    for what, attr in (("intermediate size", "intermediate_size"),
                       ("MoE intermediate size", "moe_intermediate_size")):
        total = getattr(hf_config, attr, None)
        if total:
            even_range(total, 0, size, what)


def _fits(hf_config: Any, size: int) -> bool:
    try:
        _check_sizes(hf_config, size)
    except ValueError:
        return False
    return True
