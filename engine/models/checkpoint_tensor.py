"""A checkpoint tensor as the loader hands it to a layer: whole, or read on demand.

The safetensors loader passes `safe_open(...).get_slice(name)` objects, so a
tensor-parallel rank reads from disk only the rows or columns it holds; tests and
other callers may pass plain tensors. `read_rows` takes either.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.distributed.sharding import RowRange

# torch.Tensor, or a safetensors slice (`get_shape()`, indexing by slices)
CheckpointTensor = Any


def shape_of(src: CheckpointTensor) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def read_rows(src: CheckpointTensor, dim: int = 0, rows: RowRange | None = None) -> torch.Tensor:
    """`src` narrowed to `rows` along `dim` (all of it when rows is None), as a tensor.

    Example: a safetensors slice of shape [64, 128], dim 1, rows [32, 64) reads
    src[:, 32:64] from disk: a [64, 32] tensor, nothing else.
    """
    if isinstance(src, torch.Tensor):
        return src if rows is None else src.narrow(dim, rows.start, rows.size)
    if rows is None:
        return src[:] if len(src.get_shape()) else src[...]
    index = (slice(None),) * dim + (slice(rows.start, rows.stop),)
    return src[index]
