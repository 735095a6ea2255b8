"""The torch attention backend: the CPU default (on CUDA: a fallback beside flash_attn
and triton). Despite its name, most of its CPU work runs in C++ (below); the ground truth
all attention paths are tested against is `pagedserve_kernels.reference.paged_attention_ref`
(tests/kernels/test_attention_kernels.py, tests/kernels/test_sliding_window_kernels.py, tests/kernels/test_softcap_kernels.py).

Its cache is head-major, one tensor per layer:

    kv_cache[0 | 1, kv_head, block_id, offset_in_block, head_dim]   (K | V)

so gathering a request's blocks along the block dimension leaves each head's
context as one contiguous [seq_len, head_dim] run: the layout SDPA's CPU kernel
is fast on, with no transpose copy after the gather.

Decodes (query length 1) and short prompt chunks (up to KERNEL_MAX_CHUNK tokens,
e.g. the suffix after a prefix-cache hit) run in one call of the C++ kernel in
`pagedserve_kernels/cpu_kernels.py`, which reads the paged cache in place (float32, bfloat16
or float16, when it builds); otherwise decodes run as batched SDPAs over their gathered
blocks, in groups of similar length. Longer prompt chunks run their own SDPA with a
causal mask offset by their cached context: SDPA's blocked kernel beats the per-row
kernel there, and the gather is then a small share of the work; for short chunks the
kernel wins (the figures behind KERNEL_MAX_CHUNK: docs/performance.md, "Figures behind
choices in the code").
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine import batch_invariant
from engine.attention import kv_int8
from engine.attention.backends.base import AttentionBackend
from engine.attention.metadata import AttentionMetadata
from engine.kv_cache.manager import cdiv
from pagedserve_kernels.cpu_kernels import HEAD_SIZES as KERNEL_HEAD_SIZES
from pagedserve_kernels.cpu_kernels import (
    PREFILL_HEAD_SIZES,
    fused_ops_for,
    paged_attention_kernel,
    prefill_attention_kernel,
)


def write_to_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    all_slots_valid: bool,
) -> None:
    """kv_cache[:, :, slot // block_size, slot % block_size] = (key, value), skipping -1.

    key/value [T, Hkv, D]. Example (block_size 4): slot 9 -> block 2, offset 1,
    which is row 9 of the cache viewed as [2, Hkv, num_blocks * block_size, D].
    """
    ops = fused_ops_for(kv_cache) if kv_cache.is_contiguous() else None
    if ops is not None and slot_mapping.dtype == torch.int64:
        ops.write_kv_cache(key, value, kv_cache, slot_mapping.contiguous())  # one C++ call
    else:
        write_to_kv_cache_torch(key, value, kv_cache, slot_mapping, all_slots_valid)


def write_to_kv_cache_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    all_slots_valid: bool,
) -> None:
    """`write_to_kv_cache` in torch ops: the reference, and the path off the CPU. An int8
    cache takes each row quantized (engine/attention/kv_int8.py)."""
    _, num_kv_heads, num_blocks, block_size, row = kv_cache.shape
    flat = kv_cache.view(2, num_kv_heads, num_blocks * block_size, row)
    if not all_slots_valid:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    if kv_cache.dtype == torch.int8:
        key, value = kv_int8.quantize_rows(key), kv_int8.quantize_rows(value)
    flat[0].index_copy_(1, slot_mapping, key.transpose(0, 1).to(kv_cache.dtype))
    flat[1].index_copy_(1, slot_mapping, value.transpose(0, 1).to(kv_cache.dtype))


def gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len_max: int,
    scratch: ScratchBuffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first `seq_len_max` positions of each row of `block_ids`.

    block_ids [B, nb] -> K, V [B, Hkv, seq_len_max, D] (views; each (request, head)
    slice is contiguous). One index_select over the cache seen as a flat list of
    [block_size, D] tiles, tile (kv, head, block) at (kv * Hkv + head) * num_blocks
    + block: torch's fastest gather (whole contiguous rows along dim 0).

    Example, Hkv 1, num_blocks 10, block_size 4, seq_len_max 6, block_ids
    [[3, 1, 8], [2, 9, 5]]: two blocks per request are needed, so the tiles read
    are K: 3 1 2 9, V: 13 11 12 19 -> [2 (K|V), 1 head, 2 requests, 8 positions]
    -> first 6 positions kept.

    With `scratch`, the copies land in reused buffers: a fresh multi-MB tensor per
    layer and step costs the kernel page faults that take longer than the copy itself.
    An int8 cache's K and V come back dequantized to float32 (new tensors).
    """
    num_reqs = block_ids.shape[0]
    _, num_kv_heads, num_blocks, block_size, head_size = kv_cache.shape
    num_blocks_needed = cdiv(seq_len_max, block_size)
    ids = block_ids[:, :num_blocks_needed].reshape(-1).long()
    tile_starts = torch.arange(2 * num_kv_heads, device=ids.device) * num_blocks
    tile_ids = (tile_starts[:, None] + ids[None, :]).reshape(-1)
    tiles = kv_cache.view(2 * num_kv_heads * num_blocks, block_size, head_size)
    if scratch is None:
        gathered = tiles.index_select(0, tile_ids)
    else:
        out = scratch.get("kv", (len(tile_ids), block_size, head_size), kv_cache)
        gathered = torch.index_select(tiles, 0, tile_ids, out=out)
    per_request = (2, num_kv_heads, num_reqs, num_blocks_needed * block_size, head_size)
    kv = gathered.view(per_request).transpose(1, 2)[:, :, :, :seq_len_max]
    if kv_cache.dtype == torch.int8:  # head_size above is the row: values + scale
        kv = kv_int8.dequantize_rows(kv)
    return kv[0], kv[1]


class ScratchBuffers:
    """Named flat buffers that grow to the largest size asked for and are reused."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if (buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype
                or buffer.device != like.device):
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


# The query (and model) dtypes the C++ decode kernel takes, and the cache dtypes it reads
# in place.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_CACHE_DTYPES = (*KERNEL_DTYPES, torch.int8)

# Decodes are batched in groups of requests of similar length, so one long context
# does not make every request in the batch pad (and copy) up to its length.
DECODE_GROUP_SIZE = 16
KERNEL_MAX_CHUNK = 64  # prompt chunks up to this many tokens take the in-place kernel


_NO_REQUESTS = np.zeros(0, dtype=np.int64)


@functools.lru_cache(maxsize=1024)
def _request_rows(num_reqs: int) -> torch.Tensor:
    """int32 [0, 1, ..., num_reqs - 1], made once per batch size (read-only: a decode
    step's row_tables; a torch op costs ~10 us in a step whose caches the weights emptied)."""
    return torch.arange(num_reqs, dtype=torch.int32)


@dataclass(frozen=True)
class KernelRows:
    """One step's query rows for the in-place kernel (computed once, used by every layer).

    Example: query lengths [1, 3, 100] (a decode, a 3-token chunk over 7 cached
    tokens, a long chunk) and seq_lens [40, 10, 100]:

        token_idx  = [0, 1, 2, 3]       the tokens of requests 0 and 1
        row_tables = [0, 1, 1, 1]       each token's block-table row (its request)
        seq_lens   = [40, 8, 9, 10]     keys each token sees: its position + 1
        sdpa_reqs  = [2]                left to SDPA
    """

    token_idx: torch.Tensor | None  # None: every token of the step, in order
    row_tables: torch.Tensor  # int32 [rows]
    seq_lens: torch.Tensor  # int32 [rows]
    sdpa_reqs: np.ndarray  # prefill requests the kernel does not take

    @staticmethod
    def plan(metadata: AttentionMetadata) -> KernelRows:
        if metadata.max_query_len == 1 and not metadata.bidirectional_spans:
            # A decode step: row r is request r's one token, reading table row r and
            # every key of its sequence (the general plan below, without its ~10 numpy
            # calls: ~40 us of a ~3 ms one-client step). Example: seq_lens [40, 7] ->
            # row_tables [0, 1], seq_lens [40, 7].
            return KernelRows(
                token_idx=None,
                row_tables=_request_rows(metadata.num_reqs),
                seq_lens=torch.from_numpy(metadata.seq_lens_np.astype(np.int32, copy=False)),
                sdpa_reqs=_NO_REQUESTS,
            )
        return KernelRows.plan_any(metadata)

    @staticmethod
    def plan_any(metadata: AttentionMetadata) -> KernelRows:
        """`plan` for any step (decodes, prompt chunks, SDPA prefills)."""
        query_lens = metadata.query_lens_np
        # Batch invariant: every row here, however long its chunk (engine.batch_invariant).
        takes = query_lens <= (np.inf if batch_invariant.enabled() else KERNEL_MAX_CHUNK)
        if metadata.bidirectional_spans:  # the kernel is causal: SDPA with their mask
            takes[list(metadata.bidirectional_spans)] = False
        qsl = metadata.query_start_loc_np
        reqs = np.flatnonzero(takes)
        lens = query_lens[reqs]
        # j = each row's index within its request's chunk: lens [1, 3] -> [0, 0, 1, 2].
        j = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        # Token j of request r sits at position seq_lens[r] - query_lens[r] + j.
        seq_lens = np.repeat(metadata.seq_lens_np[reqs] - lens + 1, lens) + j
        if len(reqs) == metadata.num_reqs:
            token_idx = None
        else:
            token_idx = torch.from_numpy(np.repeat(qsl[reqs], lens) + j)
        return KernelRows(
            token_idx=token_idx,
            row_tables=torch.from_numpy(np.repeat(reqs, lens).astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            sdpa_reqs=np.flatnonzero(~takes),
        )


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, use_cpu_kernel: bool = True) -> None:
        self.scratch = ScratchBuffers()
        self.kernel = paged_attention_kernel() if use_cpu_kernel else None
        self._planned: tuple[np.ndarray, KernelRows] | None = None

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_kv_heads, num_blocks, block_size, head_size)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale,
                sliding_window: int | None = None, logit_softcap: float | None = None):
        num_tokens = metadata.num_actual_tokens
        out = torch.empty_like(query)
        scores = Scores(scale, logit_softcap)
        if kv_cache is None:  # profiling pass: every request is a fresh prefill
            self._prefill_without_cache(query, key, value, metadata, scores, out,
                                        sliding_window)
            return out
        if key.shape[0] != num_tokens:  # padded beyond the real tokens
            key, value = key[:num_tokens], value[:num_tokens]
        write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping[:num_tokens],
                          all_slots_valid=True)
        if (self.kernel_fits(query.dtype, query.shape[-1], kv_cache) and not logit_softcap
                and metadata.block_table.dtype == torch.int32):
            prefill_reqs = self._attend_with_kernel(query, kv_cache, metadata, scale, out,
                                                    sliding_window or 0)
        else:
            decode_reqs = metadata.decode_reqs_np
            if len(decode_reqs):
                by_length = decode_reqs[np.argsort(metadata.seq_lens_np[decode_reqs],
                                                   kind="stable")]
                for group in np.array_split(by_length, cdiv(len(by_length), DECODE_GROUP_SIZE)):
                    self._decode(query, kv_cache, metadata, group, scores, out, sliding_window)
            prefill_reqs = metadata.prefill_reqs_np
        for req in prefill_reqs:
            self._prefill(query, key, value, kv_cache, metadata, int(req), scores, out,
                          sliding_window)
        return out

    def kernel_fits(self, query_dtype: torch.dtype, head_size: int, kv_cache: torch.Tensor
                    ) -> bool:
        """Whether the in-place C++ kernel takes queries of this dtype and head size
        over this cache."""
        return (self.kernel is not None and kv_cache.device.type == "cpu"
                and query_dtype in KERNEL_DTYPES and kv_cache.dtype in KERNEL_CACHE_DTYPES
                and kv_cache.is_contiguous() and head_size in KERNEL_HEAD_SIZES)

    def kernel_rows(self, metadata: AttentionMetadata) -> KernelRows:
        """The step's `KernelRows`, planned on the first layer's call and reused."""
        # Keyed by the step's lengths array, which every KV group's metadata shares (the
        # plan reads no block table): one plan per step, whichever group asks first.
        if self._planned is None or self._planned[0] is not metadata.seq_lens_np:
            self._planned = (metadata.seq_lens_np, KernelRows.plan(metadata))
        return self._planned[1]

    def _attend_with_kernel(self, query, kv_cache, metadata, scale, out,
                            sliding_window: int) -> np.ndarray:
        """Decodes and short chunks in one kernel call, straight from the paged cache;
        returns the prefill requests left for SDPA.

        The kernel takes float32 queries and writes float32 outputs whatever the
        cache's dtype; bf16/fp16 queries are widened first and outputs rounded back.
        """
        rows = self.kernel_rows(metadata)
        if len(rows.seq_lens) == 0:
            return rows.sdpa_reqs
        # The kernel computes in float32 and writes rows in the query's dtype.
        if rows.token_idx is None:  # every token (the usual decode step)
            q = query[: metadata.num_actual_tokens]
            if q.dtype == out.dtype and q.is_contiguous() and out.is_contiguous():
                self.kernel(out[: len(q)], q, kv_cache, metadata.block_table, rows.row_tables,
                            rows.seq_lens, scale, sliding_window)
                return rows.sdpa_reqs
        else:
            q = query[rows.token_idx]
        q = q.to(out.dtype).contiguous()
        result = torch.empty_like(q)
        self.kernel(result, q, kv_cache, metadata.block_table, rows.row_tables, rows.seq_lens,
                    scale, sliding_window)
        if rows.token_idx is None:
            out[: len(q)] = result
        else:
            out[rows.token_idx] = result
        return rows.sdpa_reqs

    def _decode(self, query, kv_cache, metadata, decode_reqs: np.ndarray, scores: Scores,
                out, sliding_window: int | None = None) -> None:
        """Single-token queries at once: [B, Hkv, group, D] against [B, Hkv, S, D].

        The query heads sharing a KV head act as that head's `group` query rows. A
        sliding window masks keys before seq_len - W (the gather still reads those
        blocks: whatever they hold now is finite, and masked).
        """
        token_idx = torch.from_numpy(metadata.query_start_loc_np[decode_reqs]).to(query.device)
        seq_lens_np = metadata.seq_lens_np[decode_reqs]
        max_len = int(seq_lens_np.max())
        req_idx = torch.from_numpy(decode_reqs).to(query.device)
        keys, values = gather_context(kv_cache, metadata.block_table[req_idx], max_len,
                                      self.scratch)
        num_kv_heads = keys.shape[1]
        q = query[token_idx]  # [B, Hq, D]
        batch, num_heads, head_size = q.shape
        q = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_size)
        seq_lens = torch.from_numpy(seq_lens_np).to(query.device)
        positions = torch.arange(max_len, device=query.device)
        mask = positions[None, :] < seq_lens[:, None]
        if sliding_window is not None:
            mask &= positions[None, :] >= seq_lens[:, None] - sliding_window
        mask = mask.view(batch, 1, 1, max_len)
        attn = scores.attend(q, keys.to(q.dtype), values.to(q.dtype), mask)
        out[token_idx] = attn.reshape(batch, num_heads, head_size)

    def _prefill(self, query, key, value, kv_cache, metadata, req: int, scores: Scores, out,
                 sliding_window: int | None = None) -> None:
        start, end = metadata.query_start_loc_np[req], metadata.query_start_loc_np[req + 1]
        seq_len = int(metadata.seq_lens_np[req])
        q = query[start:end]
        if seq_len == end - start:  # nothing cached before: the new K/V are the context
            keys, values = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
        else:
            # With a window, read from the block of the first key any query sees:
            # block_size 4, W 6, a 2-token chunk at positions 9, 10 -> keys 4..10,
            # blocks 1 and 2, positions 4..10.
            first_block = 0
            if sliding_window is not None:
                first_block = max(0, seq_len - (end - start) - sliding_window + 1) // \
                    kv_cache.shape[3]
            first_key = first_block * kv_cache.shape[3]
            keys, values = gather_context(
                kv_cache, metadata.block_table[req : req + 1, first_block:], seq_len - first_key,
                self.scratch)  # the window mask needs only relative positions
            keys, values = keys[0].to(q.dtype), values[0].to(q.dtype)
        spans = metadata.bidirectional_spans and metadata.bidirectional_spans.get(req)
        if spans:  # positions relative to the context's first key
            first_key = seq_len - keys.shape[1]
            spans = [(first - first_key, end - first_key) for first, end in spans]
        out[start:end] = _causal_attention(q, keys, values, scores, sliding_window, spans)

    def _prefill_without_cache(self, query, key, value, metadata, scores: Scores, out,
                               sliding_window: int | None = None) -> None:
        qsl = metadata.query_start_loc_np
        spans = metadata.bidirectional_spans or {}
        for req in range(metadata.num_reqs):
            start, end = qsl[req], qsl[req + 1]
            out[start:end] = _causal_attention(
                query[start:end], key[start:end].transpose(0, 1),
                value[start:end].transpose(0, 1), scores, sliding_window, spans.get(req),
            )


@dataclass(frozen=True)
class Scores:
    """How scores q.k become attention weights: times `scale`, then (with a `softcap` c,
    Gemma 2) c * tanh(s / c), then the masked softmax.

    Without a cap this is SDPA (its fused CPU kernel); with one, SDPA has no place for
    the tanh, so the scores are formed, capped and softmaxed here in float32.
    """

    scale: float
    softcap: float | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """SDPA's contract: q [..., L, D], k / v [..., S, D], a boolean `mask`
        broadcastable to [..., L, S] (True: attend), or `is_causal`."""
        if not self.softcap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                  scale=self.scale)
        # Few ops on few elements: each op's thread handoff costs more than its work here.
        capped = torch.matmul(q.float() * (self.scale / self.softcap),
                              k.float().transpose(-1, -2)).tanh_().mul_(self.softcap)
        if is_causal:
            length = capped.shape[-1]
            mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            capped.masked_fill_(mask.logical_not(), float("-inf"))
        return torch.matmul(torch.softmax(capped, dim=-1), v.float()).to(q.dtype)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scores: Scores,
                      sliding_window: int | None = None,
                      spans: list[tuple[int, int]] | None = None):
    """q [L, Hq, D] are the LAST L positions of a head-major context k, v [Hkv, S, D]
    (a whole sequence, or its tail from some block on).

    Query i sits at position S - L + i (of the context) and sees keys 0 .. S - L + i:

        S=5, L=2:  keys   0 1 2 3 4
                   q0 ->  1 1 1 1 0
                   q1 ->  1 1 1 1 1

    With a sliding window W it sees only the last W of those (absolute positions
    p - W + 1 .. p; W=2: q0 -> keys 2 3, q1 -> keys 3 4).

    `spans` (context positions [first, end)): a query inside one also sees the span's
    later keys, as Gemma 3's image tokens do (the window still applies to earlier keys):

        S=5, L=3, span (2, 4):  keys   0 1 2 3 4
                                q0 ->  1 1 1 1 0     (position 2, in the span: sees 3)
                                q1 ->  1 1 1 1 0
                                q2 ->  1 1 1 1 1

    bfloat16 on a CPU with AVX512-BF16 (no span, window or softcap) takes
    prefill_attention.cpp. Otherwise KV heads are expanded to the query heads and inputs
    made 4-D: that is what lets SDPA take its fused CPU kernel instead of the slower math path.
    """
    query_len, seq_len = q.shape[0], k.shape[1]
    # Every query sees every earlier key: no span, no window that cuts the context.
    plain_causal = not spans and (sliding_window is None or sliding_window >= seq_len)
    if (plain_causal and q.dtype == torch.bfloat16 and q.device.type == "cpu"
            and not scores.softcap and q.shape[-1] in PREFILL_HEAD_SIZES):
        kernel = prefill_attention_kernel()
        if kernel is not None:  # AVX512-BF16: ~3x torch's flash kernel at 2,048 tokens
            out = torch.empty_like(q)
            kernel(out, _last_dim_contiguous(q), _last_dim_contiguous(k),
                   _last_dim_contiguous(v), scores.scale)
            return out
    group = q.shape[1] // k.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.repeat_interleave(group, dim=0).unsqueeze(0)
    vh = v.repeat_interleave(group, dim=0).unsqueeze(0)
    if plain_causal and query_len == seq_len:
        result = scores.attend(qh, kh, vh, is_causal=True)
    elif plain_causal and not scores.softcap and q.device.type == "cpu":
        result = _attend_past_then_causal(qh, kh, vh, scores.scale)
    else:
        query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        for first, end in spans or ():
            in_span_q = (query_pos >= first) & (query_pos < end)
            in_span_k = (key_pos >= first) & (key_pos < end)
            mask |= in_span_q[:, None] & in_span_k[None, :]
        if sliding_window is not None:
            mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
        result = scores.attend(qh, kh, vh, mask)
    return result[0].transpose(0, 1)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _attend_past_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Causal attention of the last L of S positions (q [1, H, L, D], k / v [1, H, S, D]),
    as two fused CPU flash calls instead of one with an [L, S] mask: every query sees
    all S - L earlier keys (no mask), then the last L keys causally (a square the
    kernel skips half of); the two softmaxes merge by their log-sum-exps:

        out = o_past * w + o_new * (1 - w),  w = e^lse_past / (e^lse_past + e^lse_new)
                                               = sigmoid(lse_past - lse_new)

    A 3,800-token prompt's second chunk (2,048 queries after 1,752 cached keys) reads
    no mask and skips the masked half of its new keys: a 1B layer 0.340 -> 0.286 s on
    a Zen 5 core pair."""
    past_len = k.shape[2] - q.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    past, past_lse = flash(q, k[:, :, :past_len], v[:, :, :past_len], 0.0, False, scale=scale)
    new, new_lse = flash(q, k[:, :, past_len:], v[:, :, past_len:], 0.0, True, scale=scale)
    weight = torch.sigmoid(past_lse - new_lse).unsqueeze(-1)
    return torch.lerp(new.float(), past.float(), weight).to(q.dtype)
