"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache, then attends over it.

    Cache layout, one tensor per layer, allocated once by the runner:
        kv_cache[0 | 1, block_id, offset_in_block, kv_head, head_dim]   (K | V)
    """

    name: str = "base"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor | None,  # None only in the start-up profiling pass
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...
