"""Pure-torch reference implementations of the paged-KV-cache and quantized-linear kernels.

The ground truth that the Triton kernels (``reshape_and_cache``, ``paged_attention``), the
C++ paged-attention kernel (``pagedserve_kernels/cpu/paged_attention.cpp``) and the C++ int4/int8
linears (``quant_linear.cpp``, ``quant_blocked.cpp``: ``quant_linear_ref``) are tested
against. They favour clarity over speed: plain indexing and a per-request loop, fp32 maths.
They need only torch (no triton, no compiler).

The other C++ kernels have their references elsewhere, because one already exists: the GGUF
linears (``gguf_linear.cpp``) are checked against gguf-py's ``dequantize`` and a float64
matmul (tests/kernels/test_gguf_kernels.py); the fused small ops (``fused_ops.cpp``) against the torch
paths of the modules they replace, e.g. ``RMSNorm.forward_torch`` (tests/engine/test_fused_ops.py);
the decoder stack (``decoder_stack.cpp``) against the Python decoder layers, bit for bit
(tests/kernels/test_fused_decoder.py).

Layouts (shared with ``pagedserve_kernels.reshape_and_cache`` and ``pagedserve_kernels.paged_attention``)::

    kv_cache        [2, num_blocks, block_size, num_kv_heads, head_size]   (0 = K, 1 = V)
    slot_mapping    int64 [num_tokens]     slot = block_id * block_size + offset, -1 = padding
    query           [num_tokens, num_heads, head_size]
    query_start_loc int32 [num_reqs + 1]   cumulative query lengths
    seq_lens        int32 [num_reqs]       context length AFTER this step (cached + new)
    block_table     int32 [num_reqs, max_num_blocks_per_req]
"""

from __future__ import annotations

import torch


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` (in place).

    Token ``t`` goes to block ``slot_mapping[t] // block_size``, offset
    ``slot_mapping[t] % block_size``. Tokens whose slot is ``-1`` (padding) are skipped.
    Values are cast to the cache dtype.
    """
    block_size = kv_cache.shape[2]
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    block_ids = slots // block_size
    offsets = slots % block_size
    kv_cache[0, block_ids, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, block_ids, offsets] = value[keep].to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the dense K and V ``[seq_len, Hkv, D]`` of one request, read through its block table.

    Position ``p`` lives at block ``block_table_row[p // block_size]``, offset
    ``p % block_size``. Table entries past ``seq_len`` are never touched.
    """
    block_size = kv_cache.shape[2]
    positions = torch.arange(seq_len, device=kv_cache.device)
    block_ids = block_table_row.to(device=kv_cache.device, dtype=torch.long)[
        positions // block_size
    ]
    offsets = positions % block_size
    return kv_cache[0, block_ids, offsets], kv_cache[1, block_ids, offsets]


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    bidirectional_spans: dict[int, list[tuple[int, int]]] | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole (paged) context.

    Request ``r`` owns query rows ``query_start_loc[r] : query_start_loc[r + 1]`` (``q_len``
    rows); they are the last ``q_len`` positions of its sequence, i.e. positions
    ``seq_lens[r] - q_len .. seq_lens[r] - 1``. The query at position ``p`` attends to the keys
    at positions ``0 .. p``. Query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``.
    Computed in fp32, written in ``query.dtype`` to ``out`` (allocated if ``None``), which is
    returned. Rows past ``query_start_loc[-1]`` (padding) are left untouched.
    ``max_query_len`` is accepted for signature compatibility and ignored. With
    ``sliding_window`` W the query at position ``p`` sees only keys ``p - W + 1 .. p``. With
    ``logit_softcap`` c each scaled score s becomes ``c * tanh(s / c)`` before the softmax.
    ``bidirectional_spans`` {r: [(first, end)]}: a query of request ``r`` at a position in
    ``[first, end)`` also sees the later keys of that span (Gemma 3's image tokens); the
    window still bounds the earlier keys.
    """
    del max_query_len
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = starts[r], starts[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        k, v = gather_kv(kv_cache, block_table[r], seq_len)  # [S, Hkv, D]
        k = k.float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [Q, Hq, D]

        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Q, S]
        if logit_softcap:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        causal = k_pos[None, :] <= q_pos[:, None]  # [Q, S]
        for span_first, span_end in (bidirectional_spans or {}).get(r, ()):
            span_q = (q_pos >= span_first) & (q_pos < span_end)
            span_k = (k_pos >= span_first) & (k_pos < span_end)
            causal |= span_q[:, None] & span_k[None, :]
        if sliding_window is not None:
            causal &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


def quantize_activations_ref(x: torch.Tensor, group: int = 32, bits: int = 16
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [M, K] -> (xq [M, K / group, group] integer values as float32, dx [M, G], sums [M, G]).

    Per group: dx = max|x| / L, xq = round(x * (1 / dx)) half to even (0 where dx = 0),
    sums = dx * sum(xq), as `pagedserve_kernels/cpu/group32_activations.h` does; L = 32767 for 16-bit
    activations, 127 for 8-bit ones (`bits`, the kernels' PAGEDSERVE_ACTIVATION_PRECISION).
    """
    rows, cols = x.shape
    groups = x.view(rows, cols // group, group)
    scales = groups.abs().amax(dim=-1) / (32767 if bits == 16 else 127)
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    xq = torch.round(groups * inverse.unsqueeze(-1))
    return xq, scales, scales * xq.sum(dim=-1)


def quant_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, group: int = 32, bits: int = 16) -> torch.Tensor:
    """The quantized linear kernels' arithmetic: x float32 [M, K], weight integers
    q [N, K] (int4: 0..15, int8: signed), scales [N, K / S] and mins [N, K / group] (float16,
    or float32 from super-block lanes), activations rounded per `group` to `bits` (16 or 8) ->

        out[m, n] = sum_s scales[n, s] dx[m, g(s)] (q[n, s] . xq[m, s]) + mins[n, g] sums[m, g]

    over scale segments s of S columns (S = group, or GGUF Q6_K's 16: two per group g(s)).
    """
    xq, dx, sums = quantize_activations_ref(x, group, bits)
    rows = x.shape[0]
    segments = scales.shape[1]
    width = x.shape[1] // segments
    qs = q.float().view(q.shape[0], segments, width)
    dots = torch.einsum("msk,nsk->mns", xq.reshape(rows, segments, width), qs)  # exact in float32
    dx_segments = dx.repeat_interleave(group // width, dim=1)
    out = (dots * scales.float().unsqueeze(0) * dx_segments.unsqueeze(1)).sum(dim=-1)
    if mins is not None:
        out = out + sums @ mins.float().T
    return out
