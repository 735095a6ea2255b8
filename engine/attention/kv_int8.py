"""The int8 KV cache (`--kv-cache-dtype int8`, CPU): half the bytes of a bfloat16 cache per
token, so attention over a long context reads half as much and the same memory holds about
twice the tokens.

Each (token, KV head) row of K or V is stored as its head_size values rounded to int8 with
one float32 scale of its own, in head_size + 4 bytes of an int8 cache tensor:

    row = [q_0 .. q_{D-1}] [the scale's 4 bytes]         value_i = scale * q_i
    scale = max_i |x_i| / 127,   q_i = round_half_even(x_i / scale)   (a row of zeros: 0s)

Example, D = 4, x = (0.5, -1.27, 0.0, 0.02): scale = 0.01, q = (50, -127, 0, 2).

The C++ kernels (`write_kv_cache` in fused_ops.cpp, `paged_attention.cpp`) write and read
the same rows; these torch functions are their reference and the path where the kernels
are not built (tests/kernels/test_int8_kv_cache.py).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per row


def row_elements(head_size: int, dtype: torch.dtype) -> int:
    """Elements of the cache's last dimension: head_size, plus the scale's bytes for the
    8-bit rows (int8 here, fp8: engine/attention/kv_fp8.py; both one byte an element)."""
    return head_size + SCALE_BYTES if dtype in (torch.int8, torch.float8_e4m3fn) else head_size


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + 4] as described above."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / divisor).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 (or kv_fp8's float8) rows [..., D + 4] -> values [..., D] in `dtype` (computed in
    float32)."""
    q = rows[..., :-SCALE_BYTES]
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (q.float() * scale).to(dtype)
