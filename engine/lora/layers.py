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
costs a dispatch); the torch path below serves CUDA and machines without the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.forward_context import LoRAMapping
from pagedserve_kernels.cpu_kernels import fused_ops_for


@dataclass
class _Adapted:
    """One adapter's matrices on one linear: the pieces' A stacked [P * r, in], their B
    transposed and side by side [r, sum of the pieces' columns], and each piece's (first
    output column, columns) [P, 2] (pagedserve_kernels/cpu/lora.cpp's layout)."""

    a_stacked: torch.Tensor
    b_t: torch.Tensor
    pieces: torch.Tensor

    def torch_pieces(self):
        """(output columns, rank columns of s, B^T columns) per piece, for the torch path.
        Example, pieces [[0, 64], [80, 16]] of rank 8: (0:64, 0:8, 0:64), (80:96, 8:16, 64:80)."""
        rank, b_col = self.b_t.shape[0], 0
        for p, (start, size) in enumerate(self.pieces.tolist()):
            yield (slice(start, start + size), slice(p * rank, (p + 1) * rank),
                   slice(b_col, b_col + size))
            b_col += size


class LinearLoRA:
    """The adapters of one linear. `pieces`: (first output column, columns) of each piece
    the checkpoint can target on its own (one piece for a plain linear)."""

    def __init__(self, pieces: list[tuple[int, int]]):
        self.pieces = pieces
        self.adapters: dict[int, _Adapted] = {}

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

    def drop_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    def add_to(self, out: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        """out += each adapter's delta on its tokens' rows (in place): one C++ call for
        every group on the CPU, torch matmuls elsewhere."""
        groups = [(rows, adapted) for lora_id, rows in mapping.groups
                  if (adapted := self.adapters.get(lora_id)) is not None]
        if not groups:
            return  # no adapter of the step targets this linear
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
