"""Triton kernel: causal attention for a mixed prefill/decode batch over the paged KV cache.

Contract (see also ``pagedserve_kernels.reference.paged_attention_ref``, the ground truth)::

    query           [T, Hq, D]      the step's tokens of all requests, concatenated
    kv_cache        [2, num_blocks, block_size, Hkv, D]   already holds this step's K/V
    block_table     int32 [R, max_blocks]   key at position p of request r lives in block
                                            block_table[r, p // block_size], offset p % block_size
    query_start_loc int32 [R + 1]   request r owns query rows query_start_loc[r] : [r + 1]
    seq_lens        int32 [R]       context length AFTER this step (cached + new tokens)
    out             [T, Hq, D]      query.dtype; rows past query_start_loc[-1] are not written

An fp8 cache (``float8_e4m3fn``, ``--kv-cache-dtype fp8``) holds rows of D + 4 bytes instead:
each (token, kv head) row of K or V is D fp8 values then its float32 scale's 4 bytes, value =
scale * fp8 (engine/attention/kv_fp8.py writes them). The kernel applies the scales outside
the dots: a key's scale multiplies its column of scores, a value's scale its column of
softmax weights, so the dots take the fp8 values widened exactly to the query's dtype.

Request r's ``q_len`` queries are the LAST q_len positions of its sequence; the query at
position p attends to keys 0..p (with a sliding window W: keys p - W + 1 .. p, and the tile
starts its walk at the block of its first query's first key). Query head h reads kv head ``h // (Hq // Hkv)`` (GQA; MHA is
the special case Hq == Hkv).

Worked example: block_size = 4, one request with 6 cached tokens and 3 new ones
(seq_len = 9, q_len = 3, ctx_len = seq_len - q_len = 6)::

    position     0 1 2 3 | 4 5 6 7 | 8
    block_table  [   5   |    2    |    7    ]   (logical block j -> physical block)
    cached       K K K K   K K                    written on earlier steps
    new                        q q   q            written by reshape_and_cache this step

    query row 0 is position 6 -> attends keys 0..6 (blocks 5, 2)
    query row 2 is position 8 -> attends keys 0..8 (blocks 5, 2, 7; only offset 0 of block 7)

The context starts mid-block (position 6 is offset 2 of logical block 1): nothing special is
needed, because every position is addressed as (block_table[p // bs], p % bs).

Grid: ``(num_reqs, num_kv_heads, num_q_tiles)``. One program handles, for one request and one
kv head, a tile of BLOCK_Q consecutive query tokens times the GROUP = Hq // Hkv query heads
that share that kv head, packed into the BLOCK_M = BLOCK_Q * GROUP rows of the tile, so each
K/V block is loaded once per group rather than once per query head. With GROUP = 4::

    tile row i:   0    1    2    3    4    5    6    7   ...
    token i//4:   t0   t0   t0   t0   t1   t1   t1   t1  ...
    head  i%4:    h0   h1   h2   h3   h0   h1   h2   h3  ...   (+ kv_head * GROUP)

The program then walks the request's KV blocks 0 .. (last position of the tile) // block_size
through the block table, one cache block per iteration, with an online (FlashAttention-style)
softmax in fp32: running row max ``m``, running denominator ``l`` and un-normalised
accumulator ``acc``, rescaled by ``exp(m_old - m_new)`` whenever the max grows. Tiles past a
request's q_len exit immediately (the grid is sized for the longest query).
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations as strings

from typing import Any

import torch

from . import cdiv, check_device, jit_kernel, next_pow2, triton_interpreted

tl: Any = None  # bound to triton.language by pagedserve_kernels.jit_kernel before the first launch

FP8_SCALE_BYTES = 4  # an fp8 cache row's float32 scale, after its head_size values


def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    kv_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    stride_out_t,
    stride_out_h,
    stride_out_d,
    stride_query_t,
    stride_query_h,
    stride_query_d,
    stride_cache_kv,  # K -> V
    stride_cache_block,
    stride_cache_offset,
    stride_cache_h,
    stride_cache_d,
    stride_block_table_r,
    stride_block_table_b,
    sliding_window,  # W > 0: a query at position p sees keys p - W + 1 .. p; 0: all keys
    softcap,  # c: each scaled score s becomes c * tanh(s / c) (only read with SOFTCAP)
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_SIZE rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block (the key tile width)
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_M: tl.constexpr,  # tile rows, a power of two >= BLOCK_Q * GROUP
    UPCAST: tl.constexpr,  # feed tl.dot fp32 operands (interpreter + bf16 only; see below)
    SOFTCAP: tl.constexpr,  # soft-cap the scores (Gemma 2)
    FP8: tl.constexpr,  # rows of HEAD_SIZE fp8 values and a float32 scale (module docstring)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tile_start = q_tile * BLOCK_Q  # first query index (within the request) of this tile
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len  # position of the request's first query

    # Tile rows -> (query token, query head); see the module docstring.
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_start + rows // GROUP  # query index within the request
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_len + q_idx  # absolute position of each row's query

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_SIZE

    q_tok = (q_start + q_idx).to(tl.int64)
    q_ptrs = (
        query_ptr
        + q_tok[:, None] * stride_query_t
        + head[:, None] * stride_query_h
        + d[None, :] * stride_query_d
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys needed by this tile: positions 0 (or, with a window, the first query's first
    # key) .. last query position of the tile. Blocks before the window are not read.
    last_pos = ctx_len + tl.minimum(tile_start + BLOCK_Q, q_len) - 1
    num_blocks = last_pos // BLOCK_SIZE + 1
    windowed = sliding_window > 0
    first_key = tl.where(windowed, tl.maximum(ctx_len + tile_start - sliding_window + 1, 0), 0)
    first_block = first_key // BLOCK_SIZE
    offs = tl.arange(0, BLOCK_SIZE)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_block_table_r
    for j in range(first_block, num_blocks):
        block_id = tl.load(bt_row + j * stride_block_table_b).to(tl.int64)
        k_pos = j * BLOCK_SIZE + offs  # [BLOCK_SIZE]
        # Slots at or past seq_len hold stale data (possibly NaN): never load them.
        kv_mask = (k_pos < seq_len)[:, None] & d_ok[None, :]
        kv_ptrs = (
            kv_cache_ptr
            + block_id * stride_cache_block
            + offs[:, None] * stride_cache_offset
            + kv_head * stride_cache_h
            + d[None, :] * stride_cache_d
        )
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_SIZE, BLOCK_D]
        v = tl.load(kv_ptrs + stride_cache_kv, mask=kv_mask, other=0.0)
        if FP8:  # the rows' scales: the 4 bytes after each row's HEAD_SIZE values
            scale_at = (kv_cache_ptr + block_id * stride_cache_block + offs * stride_cache_offset
                        + kv_head * stride_cache_h + HEAD_SIZE)  # [BLOCK_SIZE] byte addresses
            k_scale = tl.load(scale_at.to(tl.pointer_type(tl.float32)), mask=k_pos < seq_len,
                              other=0.0)
            v_scale = tl.load((scale_at + stride_cache_kv).to(tl.pointer_type(tl.float32)),
                              mask=k_pos < seq_len, other=0.0)
            k = k.to(q.dtype)  # exact: e4m3 values are bf16 / fp16 / fp32 values
            v = v.to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_SIZE]
        if FP8:
            s = s * k_scale[None, :]
        if SOFTCAP:  # c * tanh(s / c), with tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (
            (k_pos[None, :] > q_pos[:, None] - sliding_window) | (sliding_window <= 0))
        s = tl.where(visible, s, float("-inf"))

        # Online softmax. Without a window key 0 is visible to every row, so m is finite
        # after the first iteration. With one, a later row of the tile may see nothing in
        # the first blocks (m stays -inf): it then subtracts 0 instead, so exp(-inf - 0)
        # is a clean 0 and never exp(-inf + inf) = NaN.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        if FP8:  # out = sum_n p[n] * (v_scale[n] * v8[n]): the scale joins the weight
            p_v = p * v_scale[None, :]
        else:
            p_v = p
        acc = acc * alpha[:, None] + tl.dot(p_v.to(v.dtype), v, input_precision="ieee")
        m = m_new

    # Rows past the request's queries (masked, never stored) may have seen no key.
    acc = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    out_ptrs = (
        out_ptr
        + q_tok[:, None] * stride_out_t
        + head[:, None] * stride_out_h
        + d[None, :] * stride_out_d
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _tile_shape(max_query_len: int, group: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per tile and tile rows (a power of two, >= 16 for dot)."""
    block_m = min(max(16, next_pow2(max_query_len * group)), 64)
    block_m = max(block_m, next_pow2(group))  # at least one token's worth of heads
    return block_m // group, block_m


def paged_attention(
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
) -> torch.Tensor:
    """Causal paged attention for a mixed batch; returns ``out`` ``[T, Hq, D]`` (query dtype).
    With ``sliding_window`` W a query at position p sees keys p - W + 1 .. p only; with
    ``logit_softcap`` c each scaled score s becomes c * tanh(s / c) before the softmax.

    See the module docstring for the contract. ``max_query_len`` (the longest q_len in the
    batch) sizes the grid; if ``None`` it is computed from ``query_start_loc``, which costs a
    device -> host sync. Rows of ``out`` past ``query_start_loc[-1]`` (padding) are not written.
    """
    num_tokens, num_heads, head_size = query.shape
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    _, _, block_size, num_kv_heads, cache_head_size = kv_cache.shape
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    assert cache_head_size == head_size + (FP8_SCALE_BYTES if fp8 else 0), (cache_head_size,
                                                                           head_size)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert fp8 or query.dtype == kv_cache.dtype, (query.dtype, kv_cache.dtype)
    assert not fp8 or kv_cache.stride(-1) == 1, kv_cache.stride()  # a row's scale follows it
    num_reqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_reqs + 1,), (query_start_loc.shape, num_reqs)
    assert block_table.dim() == 2 and block_table.shape[0] >= num_reqs, block_table.shape
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape, (out.shape, query.shape)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_reqs else 0
    if num_reqs == 0 or max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    block_q, block_m = _tile_shape(max_query_len, group)
    grid = (num_reqs, num_kv_heads, cdiv(max_query_len, block_q))
    check_device(query)
    kernel = jit_kernel(_paged_attention_kernel)
    # The Triton interpreter's tl.dot multiplies bf16 operands as their raw uint16 bit patterns
    # (numpy has no bf16), so under the interpreter bf16 tiles are upcast to fp32 first. On a
    # GPU UPCAST is False and the dots run on the native dtype.
    upcast = query.dtype == torch.bfloat16 and triton_interpreted()
    kernel[grid](
        out,
        query,
        kv_cache,
        block_table,
        query_start_loc,
        seq_lens,
        float(scale),
        *out.stride(),
        *query.stride(),
        *kv_cache.stride(),
        *block_table.stride(),
        sliding_window or 0,
        float(logit_softcap or 0.0),
        HEAD_SIZE=head_size,
        BLOCK_D=next_pow2(head_size),
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        UPCAST=upcast,
        SOFTCAP=bool(logit_softcap),
        FP8=fp8,
    )
    return out
