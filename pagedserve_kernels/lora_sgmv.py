"""Triton kernels: the LoRA side path of one linear for every adapter of a step, grouped by
adapter (Punica's SGMV: a shrink launch, then an expand launch, for all the groups).

Contract (``lora_add``)::

    out        [T, N]               the base linear's output; written in place
    x          [T, K]               the linear's input
    a_stack    [S, P * R, K]        slot s's A of piece p in rows p*R .. p*R + r (zeros past
                                    its rank r, and for a piece it does not adapt)
    b_stack    [S, R, N]            slot s's B^T, scaled, in out's own columns (zeros past the
                                    rank and in the columns of pieces it does not adapt)
    piece_tiles int32 [tiles, 3]    the expand's column tiles: (first column, end column,
                                    first rank row of s), each inside one piece
    rows       int64 [M]            the groups' tokens, group after group
    group_start int32 [G + 1]       group g's tokens are rows[group_start[g] : group_start[g+1]]
    group_slot int32 [G]            the slot of group g's adapter; -1: the group's adapter
                                    does not adapt this linear (skipped)

    s[m, :]              = x[rows[m]] a_stack[slot]^T              (shrink, float32, [M, P*R])
    out[rows[m], c]     += s[m, tile's rank rows] . b_stack[slot][:, c]    (expand)

Worked example, qkv with q 64 columns, k 16, v 16 (N = 96), R = 16, BLOCK_N = 32:
piece_tiles = [[0, 32, 0], [32, 64, 0], [64, 80, 16], [80, 96, 32]]: out columns 32..63 take
s[:, 0:16] . B^T[:, 32:64] (q's rank rows), columns 80..95 take s[:, 32:48] (v's).
Two requests of adapter slot 2 (tokens 0, 1) and one of slot 0 (token 3), token 2 the
base's: rows [0, 1, 3], group_start [0, 2, 3], group_slot [2, 0].

Each program of the shrink computes a [BLOCK_M tokens, BLOCK_J stacked ranks] tile of s for
one group with tl.dot over K; each program of the expand a [BLOCK_M, BLOCK_N] tile of out
for one group and one column tile. A token belongs to one group: no two programs write the
same element of out.
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations as strings

from typing import Any

import torch

from . import cdiv, check_device, jit_kernel, next_pow2, triton_interpreted

tl: Any = None  # bound to triton.language by pagedserve_kernels.jit_kernel before the first launch

BLOCK_M = 16  # tokens per tile (tl.dot needs 16 or more)
BLOCK_N = 64  # out columns per expand tile
BLOCK_K = 64  # input features per shrink step


def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, rows_ptr, group_start_ptr, group_slot_ptr,
    K, STACKED,
    stride_x_t, stride_a_slot, stride_a_row, stride_s_m,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # fp32 operands for tl.dot (the interpreter's bf16; see lora_add)
):
    group = tl.program_id(0)
    m_tile = tl.program_id(1)
    j_tile = tl.program_id(2)
    first = tl.load(group_start_ptr + group)
    count = tl.load(group_start_ptr + group + 1) - first
    if m_tile * BLOCK_M >= count:
        return  # this group has fewer tokens than the grid's largest
    slot = tl.load(group_slot_ptr + group).to(tl.int64)
    if slot < 0:
        return  # an adapter of the step that does not adapt this linear
    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < count
    rows = tl.load(rows_ptr + first + m, mask=m_ok, other=0)
    j = j_tile * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = j < STACKED
    acc = tl.zeros([BLOCK_M, BLOCK_J], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x_t + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_ptr + slot * stride_a_slot + j[:, None] * stride_a_row + k[None, :],
                    mask=j_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_J, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        else:
            a = a.to(x.dtype)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")
    tl.store(s_ptr + (first + m)[:, None] * stride_s_m + j[None, :], acc,
             mask=m_ok[:, None] & j_ok[None, :])


def _expand_kernel(
    out_ptr, s_ptr, b_ptr, tiles_ptr, rows_ptr, group_start_ptr, group_slot_ptr,
    RANK,
    stride_out_t, stride_s_m, stride_b_slot, stride_b_rank,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    group = tl.program_id(0)
    m_tile = tl.program_id(1)
    tile = tl.program_id(2)
    first = tl.load(group_start_ptr + group)
    count = tl.load(group_start_ptr + group + 1) - first
    if m_tile * BLOCK_M >= count:
        return
    slot = tl.load(group_slot_ptr + group).to(tl.int64)
    if slot < 0:
        return
    col_start = tl.load(tiles_ptr + tile * 3)
    col_end = tl.load(tiles_ptr + tile * 3 + 1)
    rank_start = tl.load(tiles_ptr + tile * 3 + 2)
    m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < count
    rows = tl.load(rows_ptr + first + m, mask=m_ok, other=0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    cols = col_start + tl.arange(0, BLOCK_N)
    cols_ok = cols < col_end
    s = tl.load(s_ptr + (first + m)[:, None] * stride_s_m + (rank_start + r)[None, :],
                mask=m_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_R] float32
    b = tl.load(b_ptr + slot * stride_b_slot + r[:, None] * stride_b_rank + cols[None, :],
                mask=r_ok[:, None] & cols_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.dot(s, b, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    out_ptrs = out_ptr + rows[:, None] * stride_out_t + cols[None, :]
    mask = m_ok[:, None] & cols_ok[None, :]
    old = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (old.to(tl.float32) + delta).to(old.dtype), mask=mask)


def piece_tiles(pieces: list[tuple[int, int]], rank: int, block_n: int = BLOCK_N
                ) -> torch.Tensor:
    """The expand's column tiles of a linear's pieces [(first column, columns)], each tile
    inside one piece: int32 [tiles, 3] of (first column, end column, first rank row).
    Example, pieces [(0, 64), (64, 16)], rank 16, block_n 32:
    [[0, 32, 0], [32, 64, 0], [64, 80, 16]]."""
    tiles = [(c, min(c + block_n, start + size), p * rank)
             for p, (start, size) in enumerate(pieces)
             for c in range(start, start + size, block_n)]
    return torch.tensor(tiles, dtype=torch.int32)


def lora_add(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor,
             tiles: torch.Tensor, rows: torch.Tensor, group_start: torch.Tensor,
             group_slot: torch.Tensor, max_group_tokens: int) -> None:
    """out[rows of each group] += its adapter's delta, in place (the module docstring's
    contract). `max_group_tokens`: the most tokens of one group (sizes the grid)."""
    num_groups = group_slot.shape[0]
    if num_groups == 0 or rows.numel() == 0:
        return
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows of x and out must be contiguous"
    assert a_stack.is_contiguous() and b_stack.is_contiguous()
    stacked, rank = a_stack.shape[1], b_stack.shape[1]
    check_device(out)
    shrunk = torch.empty(rows.numel(), stacked, dtype=torch.float32, device=x.device)
    m_tiles = cdiv(max_group_tokens, BLOCK_M)
    block_j = max(16, min(64, next_pow2(stacked)))
    # The interpreter's tl.dot multiplies bf16 operands as raw uint16 bit patterns (numpy has
    # no bf16): there the tiles are upcast to fp32 first; on a GPU the dots run on the dtype.
    upcast = x.dtype == torch.bfloat16 and triton_interpreted()
    jit_kernel(_shrink_kernel)[(num_groups, m_tiles, cdiv(stacked, block_j))](
        x, a_stack, shrunk, rows, group_start, group_slot,
        x.shape[1], stacked,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), shrunk.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_J=block_j, BLOCK_K=BLOCK_K, UPCAST=upcast,
    )
    jit_kernel(_expand_kernel)[(num_groups, m_tiles, tiles.shape[0])](
        out, shrunk, b_stack, tiles, rows, group_start, group_slot,
        rank,
        out.stride(0), shrunk.stride(0), b_stack.stride(0), b_stack.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=max(16, next_pow2(rank)), BLOCK_N=BLOCK_N,
    )
