"""Sliding-window attention in every kernel, against the torch reference.

Windows smaller than a block (and starting mid-block), equal to a block, and larger than
a block (not a multiple of it), over a batch of a long prefill, a prompt chunk over a
cached context, and decodes. The kernels get a block table whose entries before each
request's window point at a poisoned block (NaN; a large finite value for the SDPA path,
whose masked NaN would still poison): a kernel that reads a block a sliding-window KV
group may already have freed fails the comparison. The reference reads the real table.
"""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels.reference import paged_attention_ref
from tests.support.attention_cases import (
    WINDOW_BATCH,
    cpu_attention_kernel,
    filled_batch,
    needs_kernels,
    poisoned_table,
    torch_backend_forward,
)

WINDOWS = [pytest.param(5, id="W5<block"), pytest.param(16, id="W16=block"),
           pytest.param(40, id="W40>block")]


def reference(batch, window: int, scale: float) -> torch.Tensor:
    return paged_attention_ref(batch.query, batch.kv_cache, batch.block_table,
                               batch.query_start_loc, batch.seq_lens, scale,
                               sliding_window=window)[: batch.num_real]


def test_reference_window_masks_exactly_the_last_w_keys():
    """The reference against a dense computation written out by hand for one query."""
    batch = filled_batch()
    window, scale = 5, 64**-0.5
    out = reference(batch, window, scale)
    # Request 1's first query: position 50, keys 46..50.
    row, pos = 40, 50
    k, v = batch.dense_k[1][pos - window + 1 : pos + 1], batch.dense_v[1][pos - window + 1 : pos + 1]
    for h in range(8):
        probs = torch.softmax(k[:, h // 4] @ batch.query[row, h] * scale, dim=0)
        torch.testing.assert_close(out[row, h], probs @ v[:, h // 4])
    # A window at least as long as every sequence is plain causal attention.
    full = paged_attention_ref(batch.query, batch.kv_cache, batch.block_table,
                               batch.query_start_loc, batch.seq_lens, scale)[: batch.num_real]
    torch.testing.assert_close(reference(batch, 1000, scale), full)


@pytest.mark.parametrize("window", WINDOWS)
def test_cpu_kernel_sliding_window(window):
    kernel = cpu_attention_kernel()
    batch = filled_batch()
    scale = 64**-0.5
    head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous()  # NaN-poisoned block 0
    table = poisoned_table(batch.block_table, WINDOW_BATCH, window)
    # One kernel row per query token: its request's table row, its position + 1 keys.
    rows, lens = [], []
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = starts[r + 1] - starts[r]
        rows += [r] * q_len
        lens += list(range(seq_len - q_len + 1, seq_len + 1))
    q = batch.query[: batch.num_real].contiguous()
    out = torch.empty_like(q)
    kernel(out, q, head_major, table, torch.tensor(rows, dtype=torch.int32),
           torch.tensor(lens, dtype=torch.int32), scale, window)
    torch.testing.assert_close(out, reference(batch, window, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["cpp", "sdpa"])
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_backend_sliding_window(window, use_cpu_kernel):
    if use_cpu_kernel:
        cpu_attention_kernel()
    scale = 64**-0.5
    out, batch = torch_backend_forward(window, use_cpu_kernel, scale)
    torch.testing.assert_close(out, reference(batch, window, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["cpp", "sdpa"])
@pytest.mark.parametrize("window", [None, 5, 12])
def test_torch_backend_bidirectional_image_spans(window, use_cpu_kernel):
    """Gemma 3's image tokens see their whole run (request 0: two runs of a 40-token
    prefill, request 1: a run in a chunk after 50 cached tokens); everyone else is causal."""
    if use_cpu_kernel:
        cpu_attention_kernel()
    spans = {0: [(5, 15), (20, 30)], 1: [(51, 55)]}
    scale = 64**-0.5
    out, batch = torch_backend_forward(window, use_cpu_kernel, scale, bidirectional_spans=spans)
    expected = paged_attention_ref(batch.query, batch.kv_cache, batch.block_table,
                                   batch.query_start_loc, batch.seq_lens, scale,
                                   sliding_window=window,
                                   bidirectional_spans=spans)[:batch.num_real]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    causal = reference(batch, window, scale)
    assert not torch.allclose(out[5:14], causal[5:14])  # the spans did change them
    # Queries outside the runs (and each run's last) attend as before.
    for rows in (slice(0, 5), slice(14, 20), slice(29, 41), slice(44, None)):
        torch.testing.assert_close(out[rows], causal[rows], rtol=1e-5, atol=1e-5)


def test_torch_backend_window_without_cache():
    """The profiling pass (no cache yet): windowed causal attention over the new tokens."""
    from engine.attention.backends.torch_backend import TorchAttentionBackend
    from tests.support.model_fixtures import prefill_metadata

    batch = filled_batch()
    specs = [(0, 40), (0, 1)]
    q = batch.query[:41]
    k = torch.cat([batch.dense_k[0], batch.dense_k[4]])
    v = torch.cat([batch.dense_v[0], batch.dense_v[4]])
    out = TorchAttentionBackend().forward(q, k, v, None, prefill_metadata([40, 1]), 0.125,
                                          sliding_window=5)
    qsl = torch.tensor([0, 40, 41], dtype=torch.int32)
    expected = paged_attention_ref(q, batch.kv_cache, batch.block_table[[0, 4]], qsl,
                                   torch.tensor([c + n for c, n in specs], dtype=torch.int32),
                                   0.125, sliding_window=5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_kernel_sliding_window(window):
    batch = filled_batch()
    scale = 64**-0.5
    table = poisoned_table(batch.block_table, WINDOW_BATCH, window)
    out = pagedserve_kernels.paged_attention(batch.query, batch.kv_cache, table, batch.query_start_loc,
                                  batch.seq_lens, scale, max_query_len=batch.max_query_len,
                                  sliding_window=window)
    torch.testing.assert_close(out[: batch.num_real], reference(batch, window, scale),
                               rtol=1e-4, atol=1e-4)
