"""The Triton backend (CUDA; runs on CPU under TRITON_INTERPRET=1 for tests)."""

from __future__ import annotations

import torch

from engine.attention import kv_fp8
from engine.attention.backends.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale,
                sliding_window: int | None = None, logit_softcap: float | None = None):
        from pagedserve_kernels.paged_attention import paged_attention
        from pagedserve_kernels.reshape_and_cache import reshape_and_cache

        if kv_cache is None:  # profiling pass: delegate to the reference path
            from engine.attention.backends.torch_backend import TorchAttentionBackend

            return TorchAttentionBackend().forward(query, key, value, None, metadata, scale,
                                                   sliding_window, logit_softcap)
        num_tokens = metadata.num_actual_tokens
        key, value, cache = key[:num_tokens], value[:num_tokens], kv_cache
        if kv_cache.dtype == kv_fp8.DTYPE:  # rows of fp8 values and a scale, copied as bytes
            key, value, cache = (kv_fp8.quantize_rows(key).view(torch.uint8),
                                 kv_fp8.quantize_rows(value).view(torch.uint8),
                                 kv_cache.view(torch.uint8))
        reshape_and_cache(key, value, cache, metadata.slot_mapping[:num_tokens])
        return paged_attention(
            query, kv_cache, metadata.block_table, metadata.query_start_loc, metadata.seq_lens,
            scale, max_query_len=metadata.max_query_len, sliding_window=sliding_window,
            logit_softcap=logit_softcap,
        )
