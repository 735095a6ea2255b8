"""The int8 KV cache (engine/attention/kv_int8.py): its rows, the C++ write against the torch
one (the same bytes), the C++ attention kernel and the torch backend's SDPA paths against
the reference attention over the dequantized cache.

A batch's unwritten slots hold NaN (the kernel must never read them) or, where the SDPA
paths gather whole blocks and mask them, large finite garbage."""

from __future__ import annotations

import pytest
import torch

from engine.attention import kv_int8
from pagedserve_kernels.reference import paged_attention_ref, reshape_and_cache_ref
from tests.support.attention_cases import (
    MIXED_BATCH,
    NO_ROW_TABLES,
    chunk_rows,
    cpu_attention_kernel,
    make_batch,
)

HEAD_SIZE = 64


def test_rows_worked_example_and_round_trip():
    rows = kv_int8.quantize_rows(torch.tensor([[0.5, -1.27, 0.0, 0.02], [0.0, 0.0, 0.0, 0.0]]))
    assert rows.dtype == torch.int8 and rows.shape == (2, 4 + kv_int8.SCALE_BYTES)
    assert rows[0, :4].tolist() == [50, -127, 0, 2] and rows[1, :4].tolist() == [0, 0, 0, 0]
    values = kv_int8.dequantize_rows(rows)
    torch.testing.assert_close(values[0], torch.tensor([0.5, -1.27, 0.0, 0.02]))
    assert values[1].eq(0).all()
    x = torch.randn(50, 3, HEAD_SIZE)
    error = (kv_int8.dequantize_rows(kv_int8.quantize_rows(x)) - x).abs()
    # Rounding to the nearest step: at most half a step (max |x| / 254) per row.
    assert (error <= x.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)).all()
    assert kv_int8.row_elements(HEAD_SIZE, torch.int8) == HEAD_SIZE + 4
    assert kv_int8.row_elements(HEAD_SIZE, torch.bfloat16) == HEAD_SIZE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_write_gives_the_torch_writes_bytes(dtype):
    from engine.attention.backends.torch_backend import write_to_kv_cache_torch
    from pagedserve_kernels.cpu_kernels import cpu_kernels

    ops = cpu_kernels()
    if ops is None:
        pytest.skip("the C++ kernels are not built here")
    gen = torch.Generator().manual_seed(0)
    heads, blocks, block_size, tokens = 3, 6, 4, 9
    key = (torch.randn(tokens, heads, HEAD_SIZE, generator=gen) * 3).to(dtype)
    value = torch.randn(tokens, heads, HEAD_SIZE, generator=gen).to(dtype)
    key[2, 1] = 0  # a row of zeros: scale 0
    slots = torch.tensor([5, 0, 23, -1, 7, 12, 1, -1, 20], dtype=torch.int64)
    shape = (2, heads, blocks, block_size, HEAD_SIZE + 4)
    expected = torch.zeros(shape, dtype=torch.int8)
    write_to_kv_cache_torch(key, value, expected, slots, all_slots_valid=False)
    actual = torch.zeros(shape, dtype=torch.int8)
    ops.write_kv_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)
    # Slot 23 (block 5, offset 3), head 2 holds token 2's key row.
    assert torch.equal(actual[0, 2, 5, 3], kv_int8.quantize_rows(key[2, 2]))


def int8_head_major(token_major: torch.Tensor) -> torch.Tensor:
    """The reference's float cache [2, blocks, block_size, Hkv, D] as an int8 head-major
    cache [2, Hkv, blocks, block_size, D + 4]."""
    return kv_int8.quantize_rows(token_major.permute(0, 3, 1, 2, 4)).contiguous()


def dequantized_token_major(head_major: torch.Tensor) -> torch.Tensor:
    return kv_int8.dequantize_rows(head_major).permute(0, 2, 3, 1, 4).contiguous()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_kernel_reads_int8_rows(num_heads, num_kv_heads, block_size):
    """Decodes over long, block-straddling contexts and prompt-chunk rows, through
    shuffled block tables, against the reference over the cache's dequantized values."""
    kernel = cpu_attention_kernel()
    scale = HEAD_SIZE**-0.5
    seq_lens = [1, block_size, block_size + 1, 300, 513]
    decode = make_batch([(n - 1, 1) for n in seq_lens], num_heads, num_kv_heads, HEAD_SIZE,
                        block_size, num_pad=0, seed=1)
    chunks = [(0, 20), (19, 6), (40, 33), (0, 1), (100, 2)]
    prompt = make_batch(chunks, num_heads, num_kv_heads, HEAD_SIZE, block_size, num_pad=0,
                        seed=2)
    for batch, row_tables, lens in ((decode, NO_ROW_TABLES, decode.seq_lens),
                                    (prompt, *chunk_rows(chunks))):
        reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
        cache = int8_head_major(batch.kv_cache)
        out = torch.full_like(batch.query, float("nan"))
        kernel(out, batch.query, cache, batch.block_table, row_tables, lens, scale)
        expected = paged_attention_ref(batch.query, dequantized_token_major(cache),
                                       batch.block_table, batch.query_start_loc,
                                       batch.seq_lens, scale)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_cpu_kernel_refuses_a_row_without_its_scale():
    kernel = cpu_attention_kernel()
    batch = make_batch([(7, 1)], 4, 4, HEAD_SIZE, 16, num_pad=0)
    cache = torch.zeros(2, 4, batch.kv_cache.shape[1], 16, HEAD_SIZE, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="head_size \\+ 4"):
        kernel(torch.empty_like(batch.query), batch.query, cache, batch.block_table,
               NO_ROW_TABLES, batch.seq_lens, 0.125)


LONG_CHUNK_BATCH = [(37, 1), (50, 70), (0, 66), (19, 6)]  # chunks past the kernel: SDPA


@pytest.mark.parametrize("specs", [MIXED_BATCH, LONG_CHUNK_BATCH], ids=["mixed", "long-chunks"])
@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["cpp-decode", "sdpa-decode"])
def test_torch_backend_over_an_int8_cache(specs, use_cpu_kernel):
    """TorchAttentionBackend.forward writes the step's K/V as int8 rows and attends over
    the cache (C++ kernel or SDPA over dequantized gathers) as the reference does over the
    dequantized cache."""
    from engine.attention.backends.torch_backend import TorchAttentionBackend
    from engine.attention.metadata import AttentionMetadata

    if use_cpu_kernel:
        cpu_attention_kernel()
    block_size, num_heads, num_kv_heads = 16, 8, 2
    batch = make_batch(specs, num_heads, num_kv_heads, HEAD_SIZE, block_size)
    batch.kv_cache = torch.where(batch.kv_cache.isnan(), 1e4, batch.kv_cache)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    cache = int8_head_major(batch.kv_cache)
    assert cache.shape == backend.kv_cache_shape(
        batch.kv_cache.shape[1], block_size, num_kv_heads,
        kv_int8.row_elements(HEAD_SIZE, torch.int8))
    metadata = AttentionMetadata(
        num_actual_tokens=batch.num_real, max_query_len=batch.max_query_len,
        max_seq_len=int(batch.seq_lens.max()), query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=batch.block_table,
        slot_mapping=batch.slot_mapping, query_start_loc_np=batch.query_start_loc.numpy(),
        seq_lens_np=batch.seq_lens.numpy())
    scale = HEAD_SIZE**-0.5
    out = backend.forward(batch.query, batch.key, batch.value, cache, metadata, scale)
    # The step's keys landed as their int8 rows.
    slots = batch.slot_mapping[: batch.num_real]
    written = cache[0].view(num_kv_heads, -1, HEAD_SIZE + 4)[:, slots].transpose(0, 1)
    assert torch.equal(written, kv_int8.quantize_rows(batch.key[: batch.num_real]))
    # Prompts of 2+ tokens that SDPA takes (all of them without the kernel, else those past
    # its chunk limit) attend over their own new K/V, not yet rounded, where nothing was cached
    # before; everywhere else every key and value comes from the int8 rows.
    expected = paged_attention_ref(batch.query, dequantized_token_major(cache),
                                   batch.block_table, batch.query_start_loc, batch.seq_lens,
                                   scale)
    fresh_sdpa = [r for r, (ctx, q_len) in enumerate(specs)
                  if ctx == 0 and q_len > 1 and (q_len > 64 or not use_cpu_kernel)]
    starts = batch.query_start_loc.tolist()
    for r in fresh_sdpa:
        reference = batch.kv_cache.clone()
        reshape_and_cache_ref(batch.key, batch.value, reference, batch.slot_mapping)
        expected[starts[r]:starts[r + 1]] = paged_attention_ref(
            batch.query, reference, batch.block_table, batch.query_start_loc,
            batch.seq_lens, scale)[starts[r]:starts[r + 1]]
    torch.testing.assert_close(out[: batch.num_real], expected[: batch.num_real],
                               rtol=1e-5, atol=1e-5)
