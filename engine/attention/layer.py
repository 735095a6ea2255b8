"""The one attention layer every model calls."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention over this layer's slice of the KV cache.

    With `sliding_window` W each query sees only its last W keys; with `logit_softcap` c
    every score s is soft-capped to c * tanh(s / c) (Gemma 2).
    `kv_cache` is set once by the model runner after it sizes the cache (in the
    backend's `kv_cache_shape` layout); the layer writes the
    step's new K/V into it and reads its context from it. Inputs and output are
    flat per token: q [T, num_heads * head_size], k/v [T, num_kv_heads * head_size].
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group into {num_kv_heads} KV heads")
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # Sliding-window attention: each query sees its last `sliding_window` keys.
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap or None
        self.kv_cache: torch.Tensor | None = None
        # Which KV-cache group's block table this layer reads (engine.kv_cache.groups);
        # set by the model runner with the cache.
        self.kv_group = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_forward_context()
        num_tokens = q.shape[0]
        out = context.backend.forward(
            q.view(num_tokens, self.num_heads, self.head_size),
            k.view(num_tokens, self.num_kv_heads, self.head_size),
            v.view(num_tokens, self.num_kv_heads, self.head_size),
            self.kv_cache,
            context.attn_metadata if self.kv_group == 0 else context.metadata_of_group(
                self.kv_group),
            self.scale,
            self.sliding_window,
            logit_softcap=self.logit_softcap,
        )
        return out.reshape(num_tokens, self.num_heads * self.head_size)
