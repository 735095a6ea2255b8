"""Paged-attention test cases shared by the kernel tests (tests/kernels/) and the GPU tests.

A batch (`make_batch`) is a list of (cached context length, new query tokens) per request
over a KV cache full of NaN: block 0 is never handed to a request (unused block-table
entries point at it) and the last block of each request is only partly written, so a
kernel that reads a slot it must not read produces NaN and fails the comparison.
`check_rows_batch_invariant` runs one kernel on prompt chunks, verify rows and decodes;
the sliding-window helpers (`WINDOW_BATCH`, `poisoned_table`, `torch_backend_forward`)
poison every block before each request's window.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import pagedserve_kernels
import pagedserve_kernels.cpu_kernels
import pagedserve_kernels.reference
from pagedserve_kernels.reference import paged_attention_ref, reshape_and_cache_ref

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
HAS_TRITON = pagedserve_kernels.triton_available()
# Whether this process can run the kernels (imports triton when present).
IN_PROCESS = HAS_TRITON and (CUDA or pagedserve_kernels.triton_interpreted())

needs_kernels = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton missing" if not HAS_TRITON else "triton compiled-mode on CPU: see fresh process",
)


# (num_heads, num_kv_heads): GQA with 4 query heads per kv head, and MHA.
HEADS = [pytest.param(8, 2, id="gqa8x2"), pytest.param(4, 4, id="mha4")]
HEAD_SIZES = [64, 128]
BLOCK_SIZES = [16, 32]

# (cached context length, new query tokens) per request; with block sizes 16 and 32 this covers:
MIXED_BATCH = [
    (0, 20),  # prefill from scratch, long enough to need two query tiles under GQA
    (19, 6),  # prefill on top of a cached prefix that ends mid-block
    (37, 1),  # decode, mid-block
    (31, 1),  # decode whose token is the first of a new block (seq_len 32 with block size 16)
    (0, 1),  # one-token prompt
]


@dataclass
class Batch:
    """A step's inputs. The cache holds every request's cached context; the new tokens' K/V
    are in ``key``/``value`` (not yet in the cache). The last ``num_pad`` token rows are
    padding (slot -1, outside ``query_start_loc``)."""

    kv_cache: torch.Tensor
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor
    query: torch.Tensor  # [T, Hq, D]
    slot_mapping: torch.Tensor  # int64 [T]
    block_table: torch.Tensor  # int32 [R, max_blocks]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    dense_k: list[torch.Tensor]  # per request, the whole sequence's K [seq_len, Hkv, D]
    dense_v: list[torch.Tensor]
    num_real: int  # tokens before the padding
    max_query_len: int


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    num_pad: int = 3,
    seed: int = 0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks_per_req = [-(-(ctx + q) // block_size) for ctx, q in specs]
    num_blocks = 1 + sum(blocks_per_req) + 2  # block 0 = poison, 2 spare blocks never used
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(specs), max(blocks_per_req) + 2, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    kv_cache = kv_cache.to(dtype)

    keys, values, slots, dense_k, dense_v = [], [], [], [], []
    for r, (ctx, q_len) in enumerate(specs):
        n = blocks_per_req[r]
        block_table[r, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
        seq_len = ctx + q_len
        k, v = randn(seq_len, num_kv_heads, head_size), randn(seq_len, num_kv_heads, head_size)
        pos = torch.arange(seq_len)
        blk, off = block_table[r, pos // block_size].long(), pos % block_size
        kv_cache[0, blk[:ctx], off[:ctx]] = k[:ctx]  # the cached context
        kv_cache[1, blk[:ctx], off[:ctx]] = v[:ctx]
        keys.append(k[ctx:])
        values.append(v[ctx:])
        slots.append(blk[ctx:] * block_size + off[ctx:])
        dense_k.append(k)
        dense_v.append(v)

    keys.append(randn(num_pad, num_kv_heads, head_size))
    values.append(randn(num_pad, num_kv_heads, head_size))
    slots.append(torch.full((num_pad,), -1, dtype=torch.long))
    q_lens = [q for _, q in specs]
    num_real = sum(q_lens)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return Batch(
        kv_cache=kv_cache.to(DEVICE),
        key=torch.cat(keys).to(DEVICE),
        value=torch.cat(values).to(DEVICE),
        query=randn(num_real + num_pad, num_heads, head_size).to(DEVICE),
        slot_mapping=torch.cat(slots).to(DEVICE),
        block_table=block_table.to(DEVICE),
        query_start_loc=query_start_loc.to(DEVICE),
        seq_lens=torch.tensor([c + q for c, q in specs], dtype=torch.int32).to(DEVICE),
        dense_k=[k.to(DEVICE) for k in dense_k],
        dense_v=[v.to(DEVICE) for v in dense_v],
        num_real=num_real,
        max_query_len=max(q_lens),
    )


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


HAS_COMPILER = pagedserve_kernels.cpu_kernels.toolchain_available()
NO_ROW_TABLES = torch.empty(0, dtype=torch.int32)  # query row b reads block-table row b


def cpu_attention_kernel():
    """The C++ CPU paged-attention kernel; where a compiler exists it must have built."""
    from pagedserve_kernels.cpu_kernels import paged_attention_kernel

    kernel = paged_attention_kernel()
    if kernel is None:
        assert not HAS_COMPILER, "a C++ compiler and ninja are here, yet the kernel did not build"
        pytest.skip("no C++ compiler or ninja: the CPU attention kernel cannot be built")
    return kernel


def chunk_rows(specs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel rows of prompt chunks: (row_tables, seq_lens), one row per token.

    Example, specs [(cached 3, 2 new), (0 cached, 1 new)]: row_tables [0, 0, 1], seq_lens
    [4, 5, 1] (each token sees the keys up to its own position).
    """
    row_tables = torch.cat([torch.full((q,), r, dtype=torch.int32)
                            for r, (_, q) in enumerate(specs)])
    seq_lens = torch.cat([torch.arange(ctx + 1, ctx + q + 1, dtype=torch.int32)
                          for ctx, q in specs])
    return row_tables, seq_lens


def check_rows_batch_invariant(attention, num_heads: int, num_kv_heads: int, head_size: int,
                               cache_dtype: torch.dtype, window: int) -> None:
    """`attention` (paged_attention's signature) on prompt chunks, a speculative step's
    rows and decodes: equal to the reference, and each row's output the same to the bit
    alone, in a run of its request's rows, or in a shuffled batch where no two rows of a
    request are neighbours (the kernel shares K/V reads across a run, not arithmetic)."""
    specs = [(0, 20), (19, 8), (40, 3), (100, 1), (7, 2)]
    batch = make_batch(specs, num_heads, num_kv_heads, head_size, 16, num_pad=0, seed=3)
    reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
    head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous().to(cache_dtype)
    row_tables, row_lens = chunk_rows(specs)
    scale = head_size**-0.5

    def attend(rows: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(batch.query[rows], float("nan"))
        attention(out, batch.query[rows].contiguous(), head_major, batch.block_table,
                  row_tables[rows].contiguous(), row_lens[rows].contiguous(), scale, window)
        return out

    all_rows = torch.arange(len(row_tables))
    together = attend(all_rows)
    shuffled = torch.randperm(len(row_tables), generator=torch.Generator().manual_seed(0))
    assert torch.equal(attend(shuffled), together[shuffled])
    for row in range(len(row_tables)):
        assert torch.equal(attend(all_rows[row:row + 1]), together[row:row + 1]), row
    expected = paged_attention_ref(batch.query, batch.kv_cache.to(cache_dtype).float(),
                                   batch.block_table, batch.query_start_loc, batch.seq_lens,
                                   scale, sliding_window=window or None)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-5)


BLOCK_SIZE = 16
# (cached context, new tokens): a prefill longer than every window, a chunk over a cached
# context ending mid-block, decodes mid-block and at a block's first slot, a 1-token prompt.
WINDOW_BATCH = [(0, 40), (50, 6), (70, 1), (31, 1), (0, 1)]


def poisoned_table(block_table: torch.Tensor, specs, window: int, poison_block: int = 0):
    """`block_table` with each request's blocks before its earliest query's window set to
    `poison_block`. Example, block size 16, W 5, 50 cached + 6 new: the first query (50)
    sees keys 46..50, so block 2 (keys 32..47) is the first read; blocks 0, 1 poisoned."""
    table = block_table.clone()
    for r, (ctx, _) in enumerate(specs):
        first_block = max(0, ctx - window + 1) // BLOCK_SIZE
        table[r, :first_block] = poison_block
    return table


def filled_batch(num_heads=8, num_kv_heads=2, head_size=64):
    batch = make_batch(WINDOW_BATCH, num_heads, num_kv_heads, head_size, BLOCK_SIZE)
    pagedserve_kernels.reference.reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache,
                                            batch.slot_mapping)
    return batch


def torch_backend_forward(window: int | None, use_cpu_kernel: bool, scale: float,
                          bidirectional_spans=None, **forward_kwargs):
    """(out [num_real rows], batch): TorchAttentionBackend.forward over WINDOW_BATCH with
    a poisoned table (the real one when `window` is None); the batch's cache then holds
    the new keys and values, as the reference expects."""
    from engine.attention.backends.torch_backend import TorchAttentionBackend
    from engine.attention.metadata import AttentionMetadata

    batch = make_batch(WINDOW_BATCH, 8, 2, 64, BLOCK_SIZE)
    # Finite poison: the SDPA decode path gathers whole contexts and masks them.
    batch.kv_cache = torch.where(batch.kv_cache.isnan(), 1e4, batch.kv_cache)
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous()
    table = batch.block_table if window is None else poisoned_table(
        batch.block_table, WINDOW_BATCH, window)
    metadata = AttentionMetadata(
        num_actual_tokens=batch.num_real, max_query_len=batch.max_query_len,
        max_seq_len=int(batch.seq_lens.max()), query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=table, slot_mapping=batch.slot_mapping,
        query_start_loc_np=batch.query_start_loc.numpy(), seq_lens_np=batch.seq_lens.numpy(),
        bidirectional_spans=bidirectional_spans)
    out = backend.forward(batch.query, batch.key, batch.value, head_major, metadata, scale,
                          sliding_window=window, **forward_kwargs)
    pagedserve_kernels.reference.reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache,
                                            batch.slot_mapping)
    return out[: batch.num_real], batch
