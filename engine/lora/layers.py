"""The low-rank side path of a linear, grouped by adapter (the shape of Punica's SGMV:
shrink, then expand, once per adapter present in the step).

    y = x W^T                         the base (dense, int4/int8 or GGUF blocks, untouched)
    y[rows of adapter a] += (x[rows] A_a^T) B_a^T     for each adapter a in the step

A merged linear (q|k|v, gate|up) holds each piece's matrices: the shrink is one matmul
with the pieces' A stacked, the expand writes each piece's columns. Worked example,
qkv with q 64, k 16, v 16 columns and an adapter of rank 8 on q and v:
    A_stacked [16, in] = A_q | A_v;  s = x A_stacked^T [T, 16]
    y[:, 0:64]  += s[:, 0:8]  B_q^T        y[:, 80:96] += s[:, 8:16] B_v^T
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.forward_context import LoRAMapping


@dataclass
class _Adapted:
    """One adapter's matrices on one linear."""

    a_stacked: torch.Tensor  # [sum of the pieces' ranks, in]
    # Per adapted piece: (first column of the piece, its columns, rank offset, rank, B [size, r]).
    pieces: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)


class LinearLoRA:
    """The adapters of one linear. `pieces`: (first output column, columns) of each piece
    the checkpoint can target on its own (one piece for a plain linear)."""

    def __init__(self, pieces: list[tuple[int, int]]):
        self.pieces = pieces
        self.adapters: dict[int, _Adapted] = {}

    def set_adapter(self, lora_id: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]
                    ) -> None:
        """`weights`: piece index -> (A [r, in], scaled B [piece columns, r])."""
        pieces, a_parts, rank_offset = [], [], 0
        for index in sorted(weights):
            a, b = weights[index]
            start, size = self.pieces[index]
            if b.shape[0] != size:
                raise ValueError(f"LoRA B has {b.shape[0]} rows for a {size}-column piece")
            pieces.append((start, size, rank_offset, a.shape[0], b))
            a_parts.append(a)
            rank_offset += a.shape[0]
        self.adapters[lora_id] = _Adapted(torch.cat(a_parts), pieces)

    def drop_adapter(self, lora_id: int) -> None:
        self.adapters.pop(lora_id, None)

    def add_to(self, out: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        """out += each adapter's delta on its tokens' rows (in place)."""
        for lora_id, rows in mapping.groups:
            adapted = self.adapters.get(lora_id)
            if adapted is None:
                continue  # this adapter does not target this linear
            x_rows = x if rows is None else x.index_select(0, rows)
            shrunk = x_rows @ adapted.a_stacked.t()
            for start, size, rank_start, rank, b in adapted.pieces:
                delta = shrunk[:, rank_start:rank_start + rank] @ b.t()
                if rows is None:
                    out[:, start:start + size] += delta
                else:
                    out[:, start:start + size].index_add_(0, rows, delta)
