"""Random GGUF block rows for kernel tests: every byte random but the float16 scales."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
# Byte offsets of each block's float16 fields (d, and dmin / m where the type has one).
_HALF_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
                T.IQ4_NL: [0], T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2],
                T.Q6_K: [208], T.IQ4_XS: [0]}


def random_gguf_rows(ggml_type: GGMLQuantizationType, rows: int, cols: int,
                     seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: random blocks of `ggml_type` with finite, moderate scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[ggml_type]
    if ggml_type in (T.F16, T.F32, T.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if ggml_type == T.F16:
            return values.astype(np.float16).view(np.uint8)
        if ggml_type == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[ggml_type]:
        halves = rng.uniform(0.002, 0.02, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, cols // block * size)
