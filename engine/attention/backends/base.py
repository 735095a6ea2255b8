"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache, then attends over it.

    One cache tensor per layer, allocated once by the runner in the shape the
    backend asks for (`kv_cache_shape`). The default, token-major layout is what
    the Triton kernels and flash-attn read:
        kv_cache[0 | 1, block_id, offset_in_block, kv_head, head_dim]   (K | V)
    """

    name: str = "base"
    # True when forward() reads the step only through the metadata's device tensors
    # and its fixed Python values, so a CUDA graph of it replays correctly for any
    # step of the same shape (engine/worker/cuda_graphs.py).
    cuda_graph_safe: bool = False

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """The shape of one layer's cache tensor (element count is the same for all).
        `head_size` is the elements of one (token, head) row: an int8 cache's include its
        scale (engine.attention.kv_int8.row_elements)."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor | None,  # None only in the start-up profiling pass
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Causal attention; with `sliding_window` W the query at position p sees only
        keys p - W + 1 .. p (W keys, as transformers' sliding-window mask), and the
        blocks before its window's first one are never read (a sliding-window KV group
        may have freed them: engine.kv_cache.single_type). With `logit_softcap` c
        (Gemma 2) each scaled score s becomes c * tanh(s / c) before the softmax."""
