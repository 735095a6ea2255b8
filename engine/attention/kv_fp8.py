"""The fp8 KV cache (`--kv-cache-dtype fp8`, the Triton backend on CUDA): half the bytes of a
bfloat16 cache per token, as the CPU's int8 cache (engine/attention/kv_int8.py).

Each (token, KV head) row of K or V is stored as its head_size values in float8 e4m3 (the
format vLLM's `fp8` cache uses) scaled by one float32 of its own, in head_size + 4
elements of a float8_e4m3fn cache tensor:

    row = [f_0 .. f_{D-1}] [the scale's 4 bytes]      value_i = scale * f_i
    scale = max_i |x_i| / 448 (e4m3's largest value),  f_i = e4m3(x_i / scale)
    (a row of zeros: scale 0, zeros)

Example, D = 4, x = (0.5, -1.75, 0.0, 0.03): scale = 1.75 / 448 = 0.00390625, x / scale =
(128, -448, 0, 7.68), stored (128, -448, 0, 7.5): the last value comes back as 0.0293.
A per-row scale keeps each row's largest value (to float32 rounding) and its small ones
within e4m3's 3-bit mantissa (relative error <= 1/16), where one scale per tensor (vLLM's default of 1.0
without calibration) leaves rows of small values to e4m3's coarser subnormals.

The Triton paged-attention kernel (pagedserve_kernels/paged_attention.py) reads these rows;
these torch functions write them (the Triton backend) and are the tests' reference.
"""

from __future__ import annotations

import torch

from engine.attention import kv_int8

DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> fp8 rows [..., D + 4] as described above."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (x / divisor).clamp_(-E4M3_MAX, E4M3_MAX).to(DTYPE)
    return torch.cat([values.view(torch.uint8), scale.view(torch.uint8)], dim=-1).view(DTYPE)


# The int8 rows' layout (a byte a value, then the scale): the same reader.
dequantize_rows = kv_int8.dequantize_rows
