"""The flash-attn backend (CUDA): `flash_attn_varlen_func` over the block table.

flash-attn's paged KV needs a block size that is a multiple of 256; the selector
checks that before choosing this backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backends.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    cuda_graph_safe = True

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale,
                sliding_window: int | None = None, logit_softcap: float | None = None):
        from flash_attn import flash_attn_varlen_func

        from pagedserve_kernels.reshape_and_cache import reshape_and_cache

        num_tokens = metadata.num_actual_tokens
        # flash-attn's window counts the keys to the left besides the query's own.
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        # flash-attn >= 2.6 soft-caps scores itself; older versions lack the argument.
        extra = {"softcap": logit_softcap} if logit_softcap else {}
        if kv_cache is None:  # profiling pass: plain varlen attention over the new tokens
            return flash_attn_varlen_func(
                query, key, value, metadata.query_start_loc, metadata.query_start_loc,
                metadata.max_query_len, metadata.max_query_len, softmax_scale=scale, causal=True,
                window_size=window, **extra,
            )
        reshape_and_cache(key[:num_tokens], value[:num_tokens], kv_cache,
                          metadata.slot_mapping[:num_tokens])
        # seq_lens [3, 5] -> cu_seqlens_k [0, 3, 8]
        cu_seqlens_k = F.pad(metadata.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return flash_attn_varlen_func(
            query[:num_tokens], kv_cache[0], kv_cache[1],
            metadata.query_start_loc, cu_seqlens_k,
            metadata.max_query_len, metadata.max_seq_len,
            softmax_scale=scale, causal=True, block_table=metadata.block_table,
            window_size=window, **extra,
        )
