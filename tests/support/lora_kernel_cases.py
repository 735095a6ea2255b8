"""The LoRA kernels' cases (tests/kernels/test_lora_kernel.py, test_lora_sgmv.py): random
adapters on a tiny merged linear and the float64 shrink-then-expand they are held to."""

from __future__ import annotations

import torch

# qkv of a tiny model: q 64 columns, k 16, v 16, input 48.
PIECES = [(0, 64), (64, 16), (80, 16)]
IN = 48


def adapter(seed: int, rank: int, pieces: list[int], dtype=torch.float32, layout=PIECES,
            in_features=IN):
    """Random (A, B) per piece, in `dtype` (the model's, as the manager keeps them)."""
    g = torch.Generator().manual_seed(seed)
    return {p: (torch.randn(rank, in_features, generator=g).to(dtype),
                torch.randn(layout[p][1], rank, generator=g).to(dtype)) for p in pieces}


def reference(out, x, groups, adapters, layout=PIECES):
    """float64: out[rows] += (x[rows] A^T) B^T piece by piece, per group."""
    want = out.double().clone()
    for lora_id, rows in groups:
        index = torch.arange(x.shape[0]) if rows is None else rows
        for piece, (a, b) in adapters[lora_id].items():
            start, size = layout[piece]
            delta = (x.double()[index] @ a.double().t()) @ b.double().t()
            want[index, start:start + size] += delta
    return want
