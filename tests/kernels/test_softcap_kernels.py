"""Attention logit soft-capping (Gemma 2: each scaled score s becomes c * tanh(s / c)
before the softmax) in every attention path, against the torch reference; alone and with
a sliding window, over a batch of a long prefill, a prompt chunk over a cached context and
decodes. Random scores here reach |s| ~ 2, so a cap of 1 bends them a lot."""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels.reference import paged_attention_ref
from tests.support.attention_cases import (
    WINDOW_BATCH,
    filled_batch,
    needs_kernels,
    poisoned_table,
    torch_backend_forward,
)

SCALE = 64**-0.5
CAP = 1.0
WINDOWS = [pytest.param(None, id="full"), pytest.param(5, id="W5")]


def reference(batch, window, cap=CAP) -> torch.Tensor:
    return paged_attention_ref(batch.query, batch.kv_cache, batch.block_table,
                               batch.query_start_loc, batch.seq_lens, SCALE,
                               sliding_window=window, logit_softcap=cap)[: batch.num_real]


def test_reference_caps_the_scores_of_one_query_written_out_by_hand():
    batch = filled_batch()
    out = reference(batch, None)
    row, pos = 40, 50  # request 1's first query: position 50, keys 0..50
    k, v = batch.dense_k[1][: pos + 1], batch.dense_v[1][: pos + 1]
    for h in range(8):
        scores = k[:, h // 4] @ batch.query[row, h] * SCALE
        assert scores.abs().max() > CAP  # the cap does bend these
        probs = torch.softmax(CAP * torch.tanh(scores / CAP), dim=0)
        torch.testing.assert_close(out[row, h], probs @ v[:, h // 4])
    assert not torch.allclose(out, reference(batch, None, cap=None), atol=1e-2)


@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["cpp-built", "sdpa"])
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_backend_soft_cap(window, use_cpu_kernel):
    """The C++ kernel has no cap: a capped layer takes the torch path even where the
    kernel is built (its rows would otherwise go to the kernel)."""
    out, batch = torch_backend_forward(window, use_cpu_kernel, SCALE, logit_softcap=CAP)
    torch.testing.assert_close(out, reference(batch, window), rtol=1e-5, atol=1e-5)


def test_torch_backend_soft_cap_without_cache():
    """The profiling pass (no cache yet): capped causal attention over the new tokens."""
    from engine.attention.backends.torch_backend import TorchAttentionBackend
    from tests.support.model_fixtures import prefill_metadata

    batch = filled_batch()
    q = batch.query[:41]
    k = torch.cat([batch.dense_k[0], batch.dense_k[4]])
    v = torch.cat([batch.dense_v[0], batch.dense_v[4]])
    out = TorchAttentionBackend().forward(q, k, v, None, prefill_metadata([40, 1]), SCALE,
                                          logit_softcap=CAP)
    expected = paged_attention_ref(q, batch.kv_cache, batch.block_table[[0, 4]],
                                   torch.tensor([0, 40, 41], dtype=torch.int32),
                                   torch.tensor([40, 1], dtype=torch.int32), SCALE,
                                   logit_softcap=CAP)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_kernel_soft_cap(window):
    batch = filled_batch()
    table = batch.block_table if window is None else poisoned_table(
        batch.block_table, WINDOW_BATCH, window)
    out = pagedserve_kernels.paged_attention(batch.query, batch.kv_cache, table, batch.query_start_loc,
                                  batch.seq_lens, SCALE, max_query_len=batch.max_query_len,
                                  sliding_window=window, logit_softcap=CAP)
    torch.testing.assert_close(out[: batch.num_real], reference(batch, window),
                               rtol=1e-4, atol=1e-4)
