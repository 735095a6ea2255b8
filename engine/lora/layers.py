"""The low-rank side path of a linear, grouped by adapter (the shape of Punica's SGMV:
shrink, then expand, once per adapter present in the step).

    y = x W^T                         the base (dense, int4/int8 or GGUF blocks, untouched)
    y[rows of adapter a] += (x[rows] A_a^T) B_a^T     for each adapter a in the step

A merged linear (q|k|v, gate|up) holds each piece's matrices: the shrink is one matmul
with the pieces' A stacked, the expand writes each piece's columns. Worked example,
qkv with q 64, k 16, v 16 columns and an adapter of rank 8 on q and v:
    A_stacked [16, in] = A_q | A_v;  s = x A_stacked^T [T, 16]
    y[:, 0:64]  += s[:, 0:8]  B_q^T        y[:, 80:96] += s[:, 8:16] B_v^T

On the CPU every group runs in one call of pagedserve_kernels/cpu/lora.cpp (torch's
small matmuls in bfloat16 are several times slower there than float32's, and each
costs a dispatch). On CUDA two Triton launches (pagedserve_kernels/lora_sgmv.py) run every
group, over a stack of the linear's adapters by slot; the torch path below serves
machines with neither.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from engine.attention.forward_context import LoRAMapping
from pagedserve_kernels import lora_sgmv, triton_available
from pagedserve_kernels.cpu_kernels import fused_ops_for

_SERIALS = itertools.count()


@dataclass
class _Adapted:
    """One adapter's matrices on one linear: the pieces' A stacked [P * r, in], their B
    transposed and side by side [r, sum of the pieces' columns], and each piece's (first
    output column, columns) [P, 2] (pagedserve_kernels/cpu/lora.cpp's layout)."""

    a_stacked: torch.Tensor
    b_t: torch.Tensor
    pieces: torch.Tensor
    # Tells one copy of an adapter from the next (the fused decoder stack's cache key).
    serial: int = field(default_factory=lambda: next(_SERIALS))

    def torch_pieces(self):
        """(output columns, rank columns of s, B^T columns) per piece, for the torch path.
        Example, pieces [[0, 64], [80, 16]] of rank 8: (0:64, 0:8, 0:64), (80:96, 8:16, 64:80)."""
        rank, b_col = self.b_t.shape[0], 0
        for p, (start, size) in enumerate(self.pieces.tolist()):
            yield (slice(start, start + size), slice(p * rank, (p + 1) * rank),
                   slice(b_col, b_col + size))
            b_col += size


@dataclass
class FlatGroups:
    """A step's groups as the Triton kernels read them (on the device): the tokens group
    after group, where each group starts, each group's adapter id; built once a step.
    Example, 4 tokens [base, a=3, a=3, b=5]: rows [1, 2, 3], group_start [0, 2, 3],
    lora_ids [3, 5], max_tokens 2."""

    rows: torch.Tensor         # int64 [M]
    group_start: torch.Tensor  # int32 [G + 1]
    lora_ids: torch.Tensor     # int64 [G]
    max_lora_id: int
    max_tokens: int


def flat_groups(mapping: LoRAMapping, num_tokens: int, device: torch.device) -> FlatGroups:
    if mapping.flat is None:
        rows = [torch.arange(num_tokens, device=device) if r is None else r.to(device)
                for _, r in mapping.groups]
        sizes = [len(r) for r in rows]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        ids = [lora_id for lora_id, _ in mapping.groups]
        mapping.flat = FlatGroups(
            torch.cat(rows).to(torch.int64),
            torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(ids, dtype=torch.int64, device=device), max(ids), max(sizes))
    return mapping.flat


@dataclass
class _SlotStack:
    """Every adapter of one linear side by side, by slot (lora_sgmv's layout): A of piece p
    in rows p*R .. of a_stack [S, P*R, in], B^T in out's own columns of b_stack [S, R, out],
    zeros past an adapter's rank and in pieces it does not adapt. slot_table[lora_id] is
    its slot, -1 for an adapter this linear does not have."""

    a_stack: torch.Tensor
    b_stack: torch.Tensor
    tiles: torch.Tensor
    slot_table: torch.Tensor


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


class LinearLoRA:
    """The adapters of one linear. `pieces`: (first output column, columns) of each piece
    the checkpoint can target on its own (one piece for a plain linear)."""

    def __init__(self, pieces: list[tuple[int, int]]):
        self.pieces = pieces
        self.adapters: dict[int, _Adapted] = {}
        self._stack: _SlotStack | None = None  # the Triton path's, rebuilt on a change

    def set_adapter(self, lora_id: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]
                    ) -> None:
        """`weights`: piece index -> (A [r, in], scaled B [piece columns, r]), one rank."""
        if len({a.shape[0] for a, _ in weights.values()}) != 1:
            raise ValueError("LoRA pieces of one adapter have different ranks")
        starts, a_parts, b_parts = [], [], []
        for index in sorted(weights):
            a, b = weights[index]
            start, size = self.pieces[index]
            if b.shape[0] != size:
                raise ValueError(f"LoRA B has {b.shape[0]} rows for a {size}-column piece")
            starts.append((start, size))
            a_parts.append(a)
            b_parts.append(b)
        self.adapters[lora_id] = _Adapted(
            torch.cat(a_parts).contiguous(), torch.cat(b_parts).t().contiguous(),
            torch.tensor(starts, dtype=torch.int64))
        self._stack = None

    def drop_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)
        self._stack = None

    def _slot_stack(self, table_size: int) -> _SlotStack:
        """The adapters stacked by slot (built when one was added or dropped, or when the
        step names an adapter id past the table). Example, adapters 3 (rank 8 on q) and 5
        (rank 16 on q, v): R 16, slot_table [-1, -1, -1, 0, -1, 1]; slot 0's q rows 0..7
        of A hold adapter 3's A_q, rows 8..15 and the v rows stay zero."""
        if self._stack is not None and self._stack.slot_table.numel() >= table_size:
            return self._stack
        first = next(iter(self.adapters.values()))
        rank = max(adapted.b_t.shape[0] for adapted in self.adapters.values())
        in_features, out_features = first.a_stacked.shape[1], max(s + n for s, n in self.pieces)
        dtype, device = first.a_stacked.dtype, first.a_stacked.device
        a_stack = torch.zeros(len(self.adapters), len(self.pieces) * rank, in_features,
                              dtype=dtype, device=device)
        b_stack = torch.zeros(len(self.adapters), rank, out_features, dtype=dtype,
                              device=device)
        size = max(table_size, max(self.adapters) + 1)
        slot_table = torch.full((size,), -1, dtype=torch.int32)
        for slot, (lora_id, adapted) in enumerate(sorted(self.adapters.items())):
            slot_table[lora_id] = slot
            r = adapted.b_t.shape[0]
            for columns, ranks, b_columns in adapted.torch_pieces():
                p = self.pieces.index((columns.start, columns.stop - columns.start))
                a_stack[slot, p * rank:p * rank + r] = adapted.a_stacked[ranks]
                b_stack[slot, :r, columns] = adapted.b_t[:, b_columns]
        self._stack = _SlotStack(a_stack, b_stack,
                                 lora_sgmv.piece_tiles(self.pieces, rank).to(device),
                                 slot_table.to(device))
        return self._stack

    def add_to(self, out: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        """out += each adapter's delta on its tokens' rows (in place): one C++ call for
        every group on the CPU, torch matmuls elsewhere."""
        groups = [(rows, adapted) for lora_id, rows in mapping.groups
                  if (adapted := self.adapters.get(lora_id)) is not None]
        if not groups:
            return  # no adapter of the step targets this linear
        if use_triton(x):
            flat = flat_groups(mapping, x.shape[0], x.device)
            stack = self._slot_stack(flat.max_lora_id + 1)
            lora_sgmv.lora_add(out, x.contiguous(), stack.a_stack, stack.b_stack, stack.tiles,
                               flat.rows, flat.group_start, stack.slot_table[flat.lora_ids],
                               flat.max_tokens)
            return
        kernels = fused_ops_for(x)
        if kernels is not None:
            empty = torch.empty(0, dtype=torch.int64)
            kernels.lora_add_(out, x.contiguous(),
                              [empty if rows is None else rows for rows, _ in groups],
                              [g.a_stacked for _, g in groups],
                              [g.b_t for _, g in groups], [g.pieces for _, g in groups])
            return
        for rows, adapted in groups:
            x_rows = x if rows is None else x.index_select(0, rows)
            shrunk = (x_rows.to(adapted.a_stacked.dtype) @ adapted.a_stacked.t())
            for columns, ranks, b_columns in adapted.torch_pieces():
                delta = (shrunk[:, ranks] @ adapted.b_t[:, b_columns]).to(out.dtype)
                if rows is None:
                    out[:, columns] += delta
                else:
                    out[:, columns].index_add_(0, rows, delta)
