"""The Triton kernels compiled on the GPU against their torch references, at model
shapes, in bf16 and fp16, and replayed inside a CUDA graph.

tests/kernels/test_attention_kernels.py runs its kernel tests on the GPU too when there is one (its
batches move to CUDA); these add what only a device shows: real head counts and
long contexts, and a captured graph that must follow its input buffers' new
contents on every replay. Skipped without CUDA (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

import pagedserve_kernels
from pagedserve_kernels.reference import paged_attention_ref, reshape_and_cache_ref
from tests.support.attention_cases import MIXED_BATCH, assert_same_cache, make_batch

pytestmark = pytest.mark.gpu

# (num_heads, num_kv_heads, head_size): SmolLM2-135M, Llama-3-8B, Qwen3-0.6B-like.
MODEL_HEADS = [pytest.param(9, 3, 64, id="9x3x64"), pytest.param(32, 8, 128, id="32x8x128"),
               pytest.param(16, 8, 128, id="16x8x128")]
HALF = [pytest.param(torch.bfloat16, 2e-2, id="bf16"), pytest.param(torch.float16, 2e-3,
                                                                     id="fp16")]
# Prefills, a chunk over a long cached prefix, decodes over up to 2,000 tokens.
LONG_BATCH = [(0, 300), (1500, 64), (2000, 1), (17, 1), (0, 1), (511, 1)]


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("dtype", "tol"), HALF)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size"), MODEL_HEADS)
def test_step_matches_reference_at_model_shapes(num_heads, num_kv_heads, head_size, dtype, tol,
                                                block_size):
    batch = make_batch(LONG_BATCH, num_heads, num_kv_heads, head_size, block_size, dtype=dtype)
    assert batch.query.is_cuda
    expected_cache = batch.kv_cache.clone()
    reshape_and_cache_ref(batch.key, batch.value, expected_cache, batch.slot_mapping)
    pagedserve_kernels.reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    assert_same_cache(batch.kv_cache, expected_cache)
    scale = head_size**-0.5
    args = (batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, scale)
    expected = paged_attention_ref(*args)
    out = pagedserve_kernels.paged_attention(*args, max_query_len=batch.max_query_len)
    n = batch.num_real
    torch.testing.assert_close(out[:n], expected[:n], rtol=tol, atol=tol)


@pytest.mark.parametrize(("dtype", "tol"), HALF)
def test_decode_graph_replays_follow_the_buffers(dtype, tol):
    """Capture reshape_and_cache + paged_attention for a decode batch of 8 once, then
    replay it over batches whose slots, block tables and lengths differ: each replay
    must match the reference on that batch's own inputs."""
    num_heads, num_kv_heads, head_size, block_size = 32, 8, 128, 16
    scale = head_size**-0.5

    def decode_batch(seed: int):
        gen = torch.Generator().manual_seed(seed)
        contexts = torch.randint(0, 700, (8,), generator=gen).tolist()
        return make_batch([(c, 1) for c in contexts], num_heads, num_kv_heads, head_size,
                          block_size, dtype=dtype, num_pad=0, seed=seed)

    first = decode_batch(0)
    # Persistent buffers: big enough for every batch below, addresses fixed from here on.
    num_blocks = 8 * (700 // block_size + 3)
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype,
                        device="cuda")
    query = torch.zeros_like(first.query)
    key, value = torch.zeros_like(first.key), torch.zeros_like(first.value)
    slots = torch.zeros_like(first.slot_mapping)
    table = torch.zeros(8, num_blocks, dtype=torch.int32, device="cuda")
    seq_lens = torch.ones_like(first.seq_lens)
    query_start_loc = first.query_start_loc.clone()  # 0..8: one token each, always
    out = torch.zeros_like(first.query)

    def step():
        pagedserve_kernels.reshape_and_cache(key, value, cache, slots)
        pagedserve_kernels.paged_attention(query, cache, table, query_start_loc, seq_lens, scale, out=out,
                                max_query_len=1)

    def load(batch) -> None:
        blocks = batch.kv_cache.shape[1]
        cache.zero_()
        cache[:, :blocks] = batch.kv_cache.nan_to_num(0.0)
        for dst, src in ((query, batch.query), (key, batch.key), (value, batch.value),
                         (slots, batch.slot_mapping), (seq_lens, batch.seq_lens)):
            dst.copy_(src)
        table.zero_()
        table[:, : batch.block_table.shape[1]] = batch.block_table

    load(first)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2, 3):
        batch = decode_batch(seed)
        load(batch)
        graph.replay()
        torch.cuda.synchronize()
        reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
        expected = paged_attention_ref(batch.query, batch.kv_cache.nan_to_num(0.0),
                                       batch.block_table, batch.query_start_loc,
                                       batch.seq_lens, scale)
        torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_mixed_batch_fp32_on_device():
    """The CPU suite's mixed batch, compiled: fp32 within 1e-4 of the reference."""
    batch = make_batch(MIXED_BATCH, 8, 2, 64, 16)
    pagedserve_kernels.reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    args = (batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.seq_lens, 0.125)
    expected = paged_attention_ref(*args)
    out = pagedserve_kernels.paged_attention(*args)
    assert not pagedserve_kernels.triton_interpreted()
    n = batch.num_real
    torch.testing.assert_close(out[:n], expected[:n], rtol=1e-4, atol=1e-4)
