"""Tests for pagedserve_kernels/: the Triton kernels against their torch references, and the references
against naive dense attention.

Without CUDA the kernels run under the Triton interpreter on CPU. With triton 3.9 that mode is
fixed per process when triton is first imported (see ``pagedserve_kernels/__init__.py``); ``kernels``
sets ``TRITON_INTERPRET=1`` itself when it is the first to import triton on a machine without
CUDA. If something else already imported triton in compiled mode, the kernel tests are rerun
in a fresh interpreter process instead (``test_kernels_in_fresh_process``). With CUDA the
kernels run compiled on the GPU.

Every batch starts from a KV cache full of NaN, block 0 is never handed to a request (unused
block-table entries point at it), and the last block of each request is only partly
written: a kernel that reads a slot it must not read produces NaN and fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pagedserve_kernels
import pagedserve_kernels.cpu_kernels
from engine.attention import kv_fp8
from pagedserve_kernels.reference import paged_attention_ref, reshape_and_cache_ref
from tests.support.attention_cases import (
    BLOCK_SIZES,
    HAS_TRITON,
    HEAD_SIZES,
    HEADS,
    IN_PROCESS,
    MIXED_BATCH,
    NO_ROW_TABLES,
    Batch,
    assert_same_cache,
    check_rows_batch_invariant,
    chunk_rows,
    cpu_attention_kernel,
    make_batch,
    needs_kernels,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def naive_attention(batch: Batch, scale: float) -> torch.Tensor:
    """Dense causal attention from the per-request K/V, one head at a time, no cache at all."""
    num_heads = batch.query.shape[1]
    group = num_heads // batch.dense_k[0].shape[1]
    out = torch.zeros(batch.num_real, *batch.query.shape[1:], dtype=torch.float32)
    starts = batch.query_start_loc.tolist()
    for r, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v, strict=True)):
        seq_len = k.shape[0]
        for i in range(starts[r], starts[r + 1]):
            pos = seq_len - (starts[r + 1] - i)  # absolute position of query row i
            for h in range(num_heads):
                kk = k[: pos + 1, h // group].float().cpu()
                vv = v[: pos + 1, h // group].float().cpu()
                scores = kk @ batch.query[i, h].float().cpu() * scale
                out[i, h] = torch.softmax(scores, dim=0) @ vv
    return out


# --------------------------------------------------------------------------------------------
# The torch references (no triton needed)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_reference_attention_matches_naive_dense(num_heads, num_kv_heads, block_size):
    batch = make_batch(MIXED_BATCH, num_heads, num_kv_heads, 64, block_size)
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    scale = 64**-0.5
    out = paged_attention_ref(
        batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, scale
    )
    expected = naive_attention(batch, scale)
    torch.testing.assert_close(out[: batch.num_real].cpu(), expected, rtol=1e-5, atol=1e-5)


def test_reference_reshape_and_cache_writes_each_token_to_its_slot():
    batch = make_batch(MIXED_BATCH, 4, 2, 64, 16)
    before = batch.kv_cache.clone()
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    expected = before.clone()
    for t, slot in enumerate(batch.slot_mapping.tolist()):
        if slot >= 0:
            expected[0, slot // 16, slot % 16] = batch.key[t]
            expected[1, slot // 16, slot % 16] = batch.value[t]
    assert_same_cache(batch.kv_cache, expected)
    # The cache now holds every request's whole sequence at the positions its table gives.
    for r, (k, v) in enumerate(zip(batch.dense_k, batch.dense_v, strict=True)):
        gk, gv = pagedserve_kernels.reference.gather_kv(batch.kv_cache, batch.block_table[r], k.shape[0])
        assert torch.equal(gk, k) and torch.equal(gv, v)


DECODE_ONLY_BATCH = [(37, 1), (31, 1), (0, 1), (100, 1)]  # a pure decode step
# Chunks longer than the kernel takes (torch_backend.KERNEL_MAX_CHUNK) go to SDPA beside it.
LONG_CHUNK_BATCH = [(37, 1), (50, 70), (0, 66), (19, 6)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("specs", [MIXED_BATCH, DECODE_ONLY_BATCH, LONG_CHUNK_BATCH],
                         ids=["mixed", "decodes", "long-chunks"])
@pytest.mark.parametrize("use_cpu_kernel", [True, False], ids=["cpp-decode", "sdpa-decode"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_torch_backend_matches_reference(num_heads, num_kv_heads, block_size, use_cpu_kernel,
                                         specs, dtype):
    """The CPU backend, in its own head-major cache layout, on the same mixed batch.

    Its decode groups run one SDPA over padded contexts with a mask, and a masked
    NaN would still poison the softmax, so unwritten slots hold large finite garbage
    (a real cache is zeroed, then holds stale but finite values).
    """
    from engine.attention.backends.torch_backend import TorchAttentionBackend
    from engine.attention.metadata import AttentionMetadata

    if use_cpu_kernel:
        cpu_attention_kernel()
    batch = make_batch(specs, num_heads, num_kv_heads, 64, block_size)
    batch.kv_cache = torch.where(batch.kv_cache.isnan(), 1e4, batch.kv_cache)
    # bf16: the reference runs in float32 on the bf16-rounded inputs.
    for name in ("query", "key", "value", "kv_cache"):
        setattr(batch, name, getattr(batch, name).to(dtype).float())
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    assert (backend.kernel is not None) == use_cpu_kernel
    num_blocks = batch.kv_cache.shape[1]
    assert backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, 64) == (
        2, num_kv_heads, num_blocks, block_size, 64)
    head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous().to(dtype)
    metadata = AttentionMetadata(
        num_actual_tokens=batch.num_real, max_query_len=batch.max_query_len,
        max_seq_len=int(batch.seq_lens.max()), query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=batch.block_table,
        slot_mapping=batch.slot_mapping, query_start_loc_np=batch.query_start_loc.numpy(),
        seq_lens_np=batch.seq_lens.numpy(),
    )
    scale = 64**-0.5
    out = backend.forward(batch.query.to(dtype), batch.key.to(dtype), batch.value.to(dtype),
                          head_major, metadata, scale)
    assert out.dtype == dtype
    expected = naive_attention(batch, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out[: batch.num_real].float(), expected, rtol=tolerance,
                               atol=tolerance)
    # It wrote the step's K/V where the reference writes them, and nothing else.
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    assert_same_cache(head_major.permute(0, 2, 3, 1, 4).float(), batch.kv_cache)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_kernel_decodes_match_reference(num_heads, num_kv_heads, block_size, cache_dtype):
    """Long, block-straddling contexts (1 .. 513 tokens) read through shuffled block tables.

    A bf16/fp16 cache is read in place and widened exactly, so the reference is the
    same attention over that cache's values in float32.
    """
    kernel = cpu_attention_kernel()
    from pagedserve_kernels.reference import gather_kv

    seq_lens = [1, block_size, block_size + 1, 300, 513]
    specs = [(n - 1, 1) for n in seq_lens]
    batch = make_batch(specs, num_heads, num_kv_heads, 64, block_size, num_pad=0, seed=1)
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    batch.kv_cache = batch.kv_cache.to(cache_dtype).float()  # the values a low-precision cache holds
    head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous().to(cache_dtype)
    out = torch.full_like(batch.query, float("nan"))
    scale = 64**-0.5
    kernel(out, batch.query, head_major, batch.block_table, NO_ROW_TABLES, batch.seq_lens, scale)
    expected = paged_attention_ref(batch.query, batch.kv_cache, batch.block_table,
                                   batch.query_start_loc, batch.seq_lens, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # and against plain dense attention on the request's own K/V
    group = num_heads // num_kv_heads
    k, v = gather_kv(batch.kv_cache, batch.block_table[3], 300)
    scores = torch.einsum("hd,shd->hs", batch.query[3], k.repeat_interleave(group, 1)) * scale
    dense = torch.einsum("hs,shd->hd", scores.softmax(-1), v.repeat_interleave(group, 1))
    torch.testing.assert_close(out[3], dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)], ids=["gqa9x3", "mha4"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_kernel_prompt_rows_match_reference(num_heads, num_kv_heads, block_size,
                                                cache_dtype):
    """Prompt chunks as kernel rows: one row per token, its request's table row, and
    causal lengths (position + 1), over fresh and cached contexts that straddle blocks."""
    kernel = cpu_attention_kernel()
    specs = [(0, 20), (19, 6), (40, 33), (0, 1), (100, 2)]
    batch = make_batch(specs, num_heads, num_kv_heads, 64, block_size, num_pad=0, seed=2)
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    batch.kv_cache = batch.kv_cache.to(cache_dtype).float()
    head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous().to(cache_dtype)
    row_tables, row_lens = chunk_rows(specs)
    out = torch.full_like(batch.query, float("nan"))
    scale = 64**-0.5
    kernel(out, batch.query, head_major, batch.block_table, row_tables, row_lens, scale)
    expected = paged_attention_ref(batch.query, batch.kv_cache, batch.block_table,
                                   batch.query_start_loc, batch.seq_lens, scale)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (4, 4, 80)],
                         ids=["gqa9x3-d64", "mha4-d80"])
@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
def test_cpu_kernel_rows_are_batch_invariant(num_heads, num_kv_heads, head_size, window,
                                             cache_dtype):
    check_rows_batch_invariant(cpu_attention_kernel(), num_heads, num_kv_heads, head_size,
                               cache_dtype, window)


def test_kernel_rows_plan_worked_example():
    """The plan in KernelRows' docstring, exactly."""
    from engine.attention.backends.torch_backend import KERNEL_MAX_CHUNK, KernelRows
    from engine.attention.metadata import AttentionMetadata

    def plan(query_start_loc: list[int], seq_lens: list[int]) -> KernelRows:
        qsl, lens = np.array(query_start_loc, np.int32), np.array(seq_lens, np.int32)
        return KernelRows.plan(AttentionMetadata(
            num_actual_tokens=int(qsl[-1]), max_query_len=100, max_seq_len=100,
            query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(lens),
            block_table=torch.zeros(3, 8, dtype=torch.int32),
            slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
            query_start_loc_np=qsl, seq_lens_np=lens))

    assert KERNEL_MAX_CHUNK < 100
    rows = plan([0, 1, 4, 104], [40, 10, 100])
    assert rows.token_idx.tolist() == [0, 1, 2, 3]
    assert rows.row_tables.tolist() == [0, 1, 1, 1]
    assert rows.seq_lens.tolist() == [40, 8, 9, 10]
    assert rows.sdpa_reqs.tolist() == [2]
    # Reordered so the long chunk comes first: the kernel's tokens are not a prefix.
    rows = plan([0, 100, 101, 104], [100, 40, 10])
    assert rows.token_idx.tolist() == [100, 101, 102, 103]
    assert rows.row_tables.tolist() == [1, 2, 2, 2]
    assert rows.seq_lens.tolist() == [40, 8, 9, 10]
    assert rows.sdpa_reqs.tolist() == [0]


def test_kernel_rows_plan_of_a_decode_step_is_the_general_plan():
    """A decode step's plan (its own short path) equals what the general plan makes."""
    from engine.attention.backends.torch_backend import KernelRows
    from engine.attention.metadata import AttentionMetadata

    lens = np.array([40, 7, 300], np.int32)
    qsl = np.arange(len(lens) + 1, dtype=np.int32)
    metadata = AttentionMetadata.from_host(qsl, lens, np.zeros((3, 20), np.int32),
                                           np.zeros(3, np.int64), torch.device("cpu"))
    assert metadata.max_query_len == 1
    fast, general = KernelRows.plan(metadata), KernelRows.plan_any(metadata)
    assert fast.token_idx is None and general.token_idx is None
    assert fast.row_tables.dtype == general.row_tables.dtype == torch.int32
    assert fast.seq_lens.dtype == general.seq_lens.dtype == torch.int32
    assert fast.row_tables.tolist() == general.row_tables.tolist() == [0, 1, 2]
    assert fast.seq_lens.tolist() == general.seq_lens.tolist() == [40, 7, 300]
    assert fast.sdpa_reqs.tolist() == general.sdpa_reqs.tolist() == []


def test_cpu_kernel_rejects_bad_inputs():
    kernel = cpu_attention_kernel()
    batch = make_batch([(20, 1)], 4, 2, 64, 16, num_pad=0)
    head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous()
    out = torch.empty_like(batch.query)
    too_long = batch.seq_lens + 1000
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        kernel(out, batch.query, head_major, batch.block_table, NO_ROW_TABLES, too_long, 1.0)
    bad_table = batch.block_table.clone()
    bad_table[0, 1] = head_major.shape[2]
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(out, batch.query, head_major, bad_table, NO_ROW_TABLES, batch.seq_lens, 1.0)
    odd = make_batch([(20, 1)], 4, 2, 48, 16, num_pad=0)
    with pytest.raises(RuntimeError, match="head_size 48 not supported"):
        kernel(torch.empty_like(odd.query), odd.query, odd.kv_cache.permute(0, 3, 1, 2, 4)
               .contiguous(), odd.block_table, NO_ROW_TABLES, odd.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 query"):
        kernel(out.double(), batch.query.double(), head_major, batch.block_table,
               NO_ROW_TABLES, batch.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="out must be like query"):
        kernel(out, batch.query.half(), head_major, batch.block_table, NO_ROW_TABLES,
               batch.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="float16 or int8 cache"):
        kernel(out, batch.query, head_major.double(), batch.block_table, NO_ROW_TABLES,
               batch.seq_lens, 1.0)
    bad_rows = torch.tensor([1], dtype=torch.int32)  # the table has one row only
    with pytest.raises(RuntimeError, match="row_tables entry out of range"):
        kernel(out, batch.query, head_major, batch.block_table, bad_rows, batch.seq_lens, 1.0)


def test_cpu_kernel_build_survives_a_stale_lock(monkeypatch):
    """A lock left by a killed build must not make every later start wait forever."""
    cpu_attention_kernel()  # built (or skipped) once
    from pagedserve_kernels import cpu_kernels as cpu_decode

    lock = cpu_decode.build_directory() / "lock"
    lock.touch()
    old = time.time() - cpu_decode.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    monkeypatch.setattr(cpu_decode, "_kernel", cpu_decode._UNSET)
    assert cpu_decode.paged_attention_kernel() is not None
    assert not lock.exists()
    monkeypatch.setenv("PAGEDSERVE_CPU_KERNELS", "0")
    assert cpu_decode.paged_attention_kernel() is None


def test_import_without_triton():
    """`import pagedserve_kernels` must not import triton, and the references must work without it."""
    code = """
import sys
import pagedserve_kernels
from engine.attention import kv_fp8
assert "triton" not in sys.modules, "import pagedserve_kernels imported triton"
sys.modules["triton"] = None  # from here on, `import triton` raises ImportError
import torch
from pagedserve_kernels.reference import reshape_and_cache_ref
cache = torch.zeros(2, 2, 4, 1, 8)
reshape_and_cache_ref(torch.ones(2, 1, 8), torch.ones(2, 1, 8), cache, torch.tensor([5, -1]))
assert cache[:, 1, 1].eq(1).all() and cache.sum() == 16
try:
    pagedserve_kernels.reshape_and_cache(torch.ones(1, 1, 8), torch.ones(1, 1, 8), cache, torch.tensor([0]))
except ImportError as e:
    assert "pagedserve_kernels.reference" in str(e)
else:
    raise AssertionError("expected ImportError")
"""
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)


# --------------------------------------------------------------------------------------------
# The Triton kernels against the references
# --------------------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize(
    "num_kv_heads,head_size,block_size",
    [(2, 64, 16), (2, 128, 32), (4, 128, 16), (3, 80, 32)],  # (3, 80): non-power-of-two tiles
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reshape_and_cache_matches_reference(num_kv_heads, head_size, block_size, dtype):
    batch = make_batch(MIXED_BATCH, num_kv_heads, num_kv_heads, head_size, block_size, dtype)
    # Move padding from the end into the middle too: -1 may appear anywhere.
    order = torch.randperm(batch.key.shape[0], generator=torch.Generator().manual_seed(1))
    key, value, slots = batch.key[order], batch.value[order], batch.slot_mapping[order]
    assert (slots == -1).sum() == 3 and slots[-1] != -1

    expected = batch.kv_cache.clone()
    reshape_and_cache_ref(key, value, expected, slots)
    pagedserve_kernels.reshape_and_cache(key, value, batch.kv_cache, slots)
    assert_same_cache(batch.kv_cache, expected)
    # Padding wrote nothing: exactly the real tokens' slots left the NaN state.
    written = ~batch.kv_cache.isnan().flatten(3).all(-1)  # [2, num_blocks, block_size]
    cached = sum(ctx for ctx, _ in MIXED_BATCH)
    assert written.sum(dim=(1, 2)).tolist() == [cached + batch.num_real] * 2


@needs_kernels
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_paged_attention_matches_reference(num_heads, num_kv_heads, head_size, block_size):
    """A whole step: reshape_and_cache then paged_attention, on a mixed batch with padding."""
    batch = make_batch(MIXED_BATCH, num_heads, num_kv_heads, head_size, block_size)
    pagedserve_kernels.reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    scale = head_size**-0.5
    args = (batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
    expected = paged_attention_ref(*args, scale)

    out = torch.full_like(batch.query, 123.0)
    result = pagedserve_kernels.paged_attention(*args, scale, out=out, max_query_len=batch.max_query_len)
    assert result is out
    n = batch.num_real
    torch.testing.assert_close(out[:n], expected[:n], rtol=1e-4, atol=1e-4)
    assert out[n:].eq(123.0).all(), "padding rows were written"


@needs_kernels
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"]
)
def test_paged_attention_half_precision(dtype, tol):
    batch = make_batch(MIXED_BATCH, 8, 2, 64, 16, dtype=dtype)
    pagedserve_kernels.reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    args = (batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
    expected = paged_attention_ref(*args, 0.125)
    out = pagedserve_kernels.paged_attention(*args, 0.125)  # max_query_len computed from query_start_loc
    assert out.dtype == dtype
    n = batch.num_real
    torch.testing.assert_close(out[:n], expected[:n], rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize(
    "specs",
    [
        pytest.param([(5, 1), (40, 1), (16, 1), (0, 1)], id="decode-only"),
        pytest.param([(0, 33)], id="one-long-prefill"),
        pytest.param([(7, 9), (0, 0), (3, 2)], id="with-empty-request"),
    ],
)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 2, 64), (6, 2, 80), (16, 1, 64)])
def test_paged_attention_shapes(specs, num_heads, num_kv_heads, head_size):
    """Other tilings: decode-only batches, many query tiles, q_len 0, GQA groups of 3 and 16,
    and a head size that is not a power of two."""
    batch = make_batch(specs, num_heads, num_kv_heads, head_size, 16)
    pagedserve_kernels.reshape_and_cache(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    args = (batch.query, batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens)
    expected = paged_attention_ref(*args, 0.1)
    out = pagedserve_kernels.paged_attention(*args, 0.1)
    n = batch.num_real
    torch.testing.assert_close(out[:n], expected[:n], rtol=1e-4, atol=1e-4)


@needs_kernels
def test_kernels_accept_strided_views():
    """q/k/v as views into one fused qkv projection (row stride != Hq * D), as the model
    passes them: the kernels must follow the strides, not assume contiguity."""
    num_heads, num_kv_heads, head_size = 8, 2, 64
    batch = make_batch(MIXED_BATCH, num_heads, num_kv_heads, head_size, 16)
    num_tokens = batch.query.shape[0]
    qkv = torch.cat(
        [t.flatten(1) for t in (batch.query, batch.key, batch.value)], dim=1
    )  # [T, (Hq + 2 Hkv) D]
    q, k, v = qkv.split([num_heads * head_size] + [num_kv_heads * head_size] * 2, dim=1)
    q = q.view(num_tokens, num_heads, head_size)
    k = k.view(num_tokens, num_kv_heads, head_size)
    v = v.view(num_tokens, num_kv_heads, head_size)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())

    expected_cache = batch.kv_cache.clone()
    reshape_and_cache_ref(batch.key, batch.value, expected_cache, batch.slot_mapping)
    pagedserve_kernels.reshape_and_cache(k, v, batch.kv_cache, batch.slot_mapping)
    assert_same_cache(batch.kv_cache, expected_cache)

    args = (batch.kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, 0.125)
    expected = paged_attention_ref(batch.query, *args)
    out = pagedserve_kernels.paged_attention(q, *args)
    n = batch.num_real
    torch.testing.assert_close(out[:n], expected[:n], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(IN_PROCESS or not HAS_TRITON, reason="kernel tests run in this process")
def test_kernels_in_fresh_process():
    """Triton was imported in compiled mode before these tests on a CPU-only machine, so the
    interpreter cannot be switched on here: rerun this file in a clean interpreter process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_takes_a_half_precision_query_as_float32_rounded(dtype):
    """A bfloat16 / float16 query and out: the float32 call on the widened query, its rows
    rounded once (bitwise), so the decoder stack needs no conversions around the kernel."""
    kernel = cpu_attention_kernel()
    batch = make_batch([(20, 1), (37, 3)], 6, 2, 64, 16, num_pad=0)
    cache = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous().to(dtype)
    query = batch.query.to(dtype)
    row_tables = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    seq_lens = torch.tensor([20, 35, 36, 37], dtype=torch.int32)
    table = batch.block_table
    expected = torch.empty_like(query, dtype=torch.float32)
    kernel(expected, query.float(), cache, table, row_tables, seq_lens, 0.125)
    out = torch.empty_like(query)
    kernel(out, query, cache, table, row_tables, seq_lens, 0.125)
    assert torch.equal(out, expected.to(dtype))


def test_fp8_rows_round_trip_within_e4m3s_mantissa():
    """kv_fp8 rows: the worked example of its docstring, each row's largest value back to
    float32 rounding, every value within 1/16 of itself (e4m3's 3-bit mantissa) or of a
    subnormal step."""
    rows = kv_fp8.quantize_rows(torch.tensor([[0.5, -1.75, 0.0, 0.03]]))
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (1, 8)
    assert kv_fp8.dequantize_rows(rows).tolist() == [[0.5, -1.75, 0.0, 0.029296875]]
    x = torch.randn(64, 3, 128) * torch.logspace(-4, 2, 64)[:, None, None]
    x[5] = 0.0  # a row of zeros: scale 0, zeros back
    back = kv_fp8.dequantize_rows(kv_fp8.quantize_rows(x))
    assert torch.equal(back[5], x[5])
    row_max = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(back.abs().amax(-1, keepdim=True), row_max, rtol=1e-6, atol=0)
    step = row_max / kv_fp8.E4M3_MAX * 2.0**-9  # e4m3's subnormal step, scaled
    assert ((back - x).abs() <= torch.maximum(x.abs() / 16, step)).all()


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-3),
                                       (torch.bfloat16, 2e-2)], ids=["fp32", "fp16", "bf16"])
def test_paged_attention_reads_an_fp8_cache(dtype, tol):
    """--kv-cache-dtype fp8 on the Triton path: the backend's write (rows quantized in torch,
    copied as bytes by reshape_and_cache) stores exactly kv_fp8's rows, and the kernel over
    the fp8 cache matches the reference over the same rows dequantized (the scales applied
    outside the dots are the same products)."""
    batch = make_batch(MIXED_BATCH, 8, 2, 64, 16, dtype=dtype)
    cache = kv_fp8.quantize_rows(batch.kv_cache)  # the cached context, NaN where unwritten
    keys, values = kv_fp8.quantize_rows(batch.key), kv_fp8.quantize_rows(batch.value)
    pagedserve_kernels.reshape_and_cache(keys.view(torch.uint8), values.view(torch.uint8),
                                         cache.view(torch.uint8), batch.slot_mapping)
    slots = batch.slot_mapping[: batch.num_real]
    written = cache.view(torch.uint8)[:, slots // 16, slots % 16]
    assert torch.equal(written[0], keys[: batch.num_real].view(torch.uint8))
    assert torch.equal(written[1], values[: batch.num_real].view(torch.uint8))
    args = (batch.block_table, batch.query_start_loc, batch.seq_lens)
    expected = paged_attention_ref(batch.query.float(), kv_fp8.dequantize_rows(cache), *args, 0.125)
    out = pagedserve_kernels.paged_attention(batch.query, cache, *args, 0.125)
    assert out.dtype == dtype
    n = batch.num_real
    torch.testing.assert_close(out[:n].float(), expected[:n], rtol=tol, atol=tol)
