"""Weight-only quantized linears on CPU: int4 and int8 in groups of 32 input columns.

A `Linear` may hold its weight as a `QuantizedWeight` instead of a dense tensor: the
weight in 4 or 8 bits with float16 scales (and mins) per group of 32 (the layout and
precision of GGUF's Q4_0 / Q4_1 / Q8_0, which therefore run exactly: 0.625 bytes per
int4 weight). There is no dense copy beside it. Batches of at most `max_rows` rows (decode
steps) take the C++ kernels of `pagedserve_kernels/cpu/quant_linear.cpp` (weights with a multiple
of 16 outputs: `pagedserve_kernels/cpu/quant_blocked.cpp`, held in blocks of 16 output rows, see
`block_int4` / `block_int8`), which read 5-6x fewer bytes than a float32 matmul, what a small decode batch costs on a memory-bound CPU;
larger batches (prefill chunks, wide decode batches) decode a tile of weight rows at a
time into the activations' dtype and multiply it with one matmul
(`pagedserve_kernels/cpu/gguf_linear.cpp`, `quant_tiled_linear`), so both paths multiply by the same
numbers. The kernels round the activations per group of 32 to int16 (at most 1.5e-5 of
the group's largest value) or, by default on AVX-512 VNNI CPUs, to int8 as llama.cpp's Q8_0
blocks (--activation-precision; there the blocked kernels also take prefill batches:
`default_max_rows`), which turns each group's dot product into a few integer instructions.

    int4 (asymmetric, Q4_1-like):  w = mins[n, g] + scales[n, g] * q,  q in [0, 15]
    int4 (symmetric, Q4_0):        w = scales[n, g] * (q - 8)  (mins = -8 * scales)
    int8 (symmetric, Q8_0):        w = scales[n, g] * q,       q in [-127, 127]

(torch's own weight-only CPU kernels, `_weight_int4pack_mm_for_cpu` and
`_weight_int8pack_mm`, take only bfloat16 scales: that rounding alone turned
SmolLM2's Q4_1 weights into a model answering "L'Étoile" to "What is the
capital of France?", so they are not used.)
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import torch

from engine import batch_invariant, cpu_info

QuantMethod = Literal["int8", "int4"]
GROUP_SIZE = 32
BLOCK_ROWS = 16  # output rows per block of the blocked int4 / int8 layouts

# Calls of each quantized kernel since start-up: tests check the kernel really ran.
# "int4"/"int8": the few-row kernels; "tiled": a many-row call decoding tiles.
KERNEL_CALLS: Counter[str] = Counter()


def default_max_rows(kind: str = "int4", dtype: torch.dtype | None = None) -> int:
    """Largest batch for which a packed weight's few-row kernel beats its tiled path
    (decoded tiles and one matmul) on this CPU; `kind` "int4" / "int8" (row-major),
    "int4-blocked" / "int8-blocked" (blocks of 16 output rows), "q6k-blocked" (the six-bit
    form of blocked int8: GGUF Q6_K, Q5_K, Q3_K) or "gguf" (the K-quant kernels of
    pagedserve_kernels/cpu/gguf_linear.cpp). `kernel_kind` names a weight's kind. `dtype` is the
    model's (activations') dtype, which the tiles are decoded into; None: the dtype that
    `--dtype auto` picks on this CPU (bfloat16 where it has native bf16, else float32).

    `PAGEDSERVE_QUANT_MAX_ROWS` overrides it (0: always the tiled path). Measured with
    `python -m benchmarks.gguf_linears` (a 1B Llama layer, 2 threads): with bfloat16 tiles
    on a CPU with native bf16 (avx512_bf16), tiles multiply cheaply and the crossover is
    where the few-row kernel's per-row work passes the decoding of a tile; float32 tiles
    cost more and the few-row kernels keep more rows. With 8-bit activations (the kernels'
    precision when the weight is built) on AVX-512 VNNI the blocked kernels take every batch.
    """
    override = os.environ.get("PAGEDSERVE_QUANT_MAX_ROWS")
    if override:
        return int(override)
    native_bf16 = cpu_info.native_bf16_reason() is not None
    float32_tiles = not native_bf16 if dtype is None else dtype == torch.float32
    avx512 = cpu_info.vector_isa() == "avx512"
    blocked = kind in ("int4-blocked", "int8-blocked", "q6k-blocked")
    # Each limit is the measured crossover of that case (the figures: docs/performance.md,
    # "Figures behind choices in the code"; full tables in docs/cpu-kernels.md).
    if blocked and _int8_products():
        # 8-bit activations through vpdpbusd (four u8 x s8 products per lane) beat bfloat16
        # tiles at every batch measured, 1,024 rows (a 1B layer on a Zen 5, ms: int4 128 rows
        # 14.7 vs 28.4, 1,024 rows 136 vs 153; Q8_0 512 rows 67 vs 85), so prefill takes them
        # too; the six-bit kinds (GGUF Q6_K, Q5_K, Q3_K: a group decoded at a time) lose
        # from ~256 rows (Q6_K, 256 rows: 55 vs 49).
        if kind != "q6k-blocked":
            return ALL_ROWS
        return 512 if float32_tiles else 128
    if blocked and avx512 and float32_tiles:
        # float32 tiles cost the tiled path most: the blocked kernels keep 512 rows.
        return 512
    if blocked and avx512:
        # Blocked int4 / int8 (pagedserve_kernels/cpu/quant_blocked.cpp), bfloat16 tiles: the
        # layer and SmolLM2's lm_head agree; GGUF Q4_K / Q6_K repacks take the same limits.
        return 32
    if float32_tiles or not native_bf16:
        # float32 tiles, or 16-bit ones whose matmuls this CPU emulates.
        return 32
    # bfloat16 tiles on native bf16 (oneDNN) multiply cheaply: the crossover comes early.
    return 8 if kind == "gguf" else 12


ALL_ROWS = 1 << 30  # a few-row limit no batch reaches


def _int8_products() -> bool:
    """Whether the packed kernels now take 8-bit activations through AVX-512 VNNI."""
    from pagedserve_kernels.cpu_kernels import activation_precision, avx512_vnni

    return avx512_vnni(cpu_info.cpu_flags()) and activation_precision() == "int8"


def kernel_kind(spec: QuantSpec, out_features: int) -> str:
    """The `default_max_rows` kind of a weight of `spec` with `out_features` outputs."""
    if out_features % BLOCK_ROWS == 0:
        return f"{spec.method}-blocked"
    return spec.method


@dataclass(frozen=True)
class QuantSpec:
    """How to quantize one linear. `symmetric` int4 is GGUF's Q4_0 (no zero point)."""

    method: QuantMethod
    symmetric: bool = False


def _kernels():
    from pagedserve_kernels.cpu_kernels import cpu_kernels

    return cpu_kernels()


class QuantizedWeight:
    """One linear's weight in int4/int8 (groups of 32, float16 scales) and its kernel.

    `data`, `scales`, `mins` come in the row-major layout (blocked here when N is a
    multiple of 16) or already blocked (`data` [N / 16, K / 32, ...]; GGUF Q4_K's and
    Q6_K's repacks, whose scales and mins are super-block lanes: see `super_block_lanes`).
    """

    def __init__(self, spec: QuantSpec, data: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor | None, max_rows: int):
        self.spec = spec
        if data.dim() == 3:
            self.out_features = data.shape[0] * BLOCK_ROWS
            self.in_features = data.shape[1] * GROUP_SIZE
        else:
            self.out_features = scales.shape[0]
            self.in_features = scales.shape[1] * GROUP_SIZE
            if self.out_features % BLOCK_ROWS == 0:
                if spec.method == "int4":
                    data, scales, mins = block_int4(data, scales, mins)
                else:
                    data, scales = block_int8(data, scales)
        # int4: uint8 [N, K / 2] (two per byte), or blocked [N / 16, K / 32, 256] (see
        # block_int4) when N is a multiple of 16; int8: int8 [N, K], or blocked
        # [N / 16, K / 32, 512] (see block_int8; Q6_K's six bits: 384, block_q6k_values).
        self.data = data
        # float16 [N, K / 32]; blocked: [N / 16, K / 32, 16], or uint8 super-block lanes
        # [N / 16, K / 256, 160 (Q4_K) or 288 (Q6_K)] (super_block_lanes)
        self.scales = scales
        self.mins = mins  # int4: shaped like scales; int8: None
        self.max_rows = max_rows
        self._kernel = _kernels()

    @property
    def blocked(self) -> bool:
        return self.data.dim() == 3

    @property
    def scale_form(self) -> str:
        """"float16", or "super-blocks-<bytes>" with "+mins" where an int8 weight has them
        (GGUF Q5_K): weights concatenate only within one form."""
        if self.scales.dtype != torch.uint8:
            return "float16"
        mins = "+mins" if self.spec.method == "int8" and self.mins is not None else ""
        return f"super-blocks-{self.scales.shape[-1]}{mins}"

    def canonical(self, ids: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(data, scales, mins) of output rows `ids` (all for None) in the row-major layout
        (int4 [N, K / 2], int8 [N, K]; scales and mins [N, K / 32], float32 for
        super-block lanes, else float16; Q6_K's scales [N, K / 16])."""
        if self.blocked:
            scales, mins = _lane_values(self.scales), _lane_values(self.mins)
            if self.spec.method == "int4":
                return unblock_int4(self.data, scales, mins, ids)
            data, row_scales = unblock_int8(int8_layout(self.data), scales, ids)
            rows = torch.arange(self.out_features) if ids is None else ids
            return data, row_scales, None if mins is None else _lane_rows(mins, rows)
        if ids is None:
            return self.data, self.scales, self.mins
        return self.data[ids], self.scales[ids], None if self.mins is None else self.mins[ids]

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scales] + ([self.mins] if self.mins is not None else [])

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def serves(self, num_rows: int) -> bool:
        """Whether a batch of `num_rows` takes the few-row integer kernel."""
        return self._kernel is not None and (num_rows <= self.max_rows or batch_invariant.enabled())

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] (any float dtype) -> x @ w.T + bias, [M, N] in x's dtype."""
        if not self.serves(x.shape[0]):
            return self._matmul_many_rows(x, bias)
        dtype = x.dtype
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            x = x.float()
        x = x if x.is_contiguous() else x.contiguous()
        # The kernels compute in float32 and round the result to x's dtype.
        if self.spec.method == "int4":
            KERNEL_CALLS["int4"] += 1
            out = self._kernel.int4_linear(x, self.data, self.scales, self.mins)
        else:
            KERNEL_CALLS["int8"] += 1
            out = self._kernel.int8_linear(x, self.data, self.scales, self.mins)
        if out.dtype != dtype:
            out = out.to(dtype)
        return out if bias is None else out + bias

    def _matmul_many_rows(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._kernel is None:  # no C++ kernels: a transient dense weight per call
            return torch.nn.functional.linear(x, self.dequantized().to(x.dtype), bias)
        KERNEL_CALLS["tiled"] += 1
        x = x if x.is_contiguous() else x.contiguous()
        mins = self.mins if self.mins is not None else _NO_TENSOR
        out = self._kernel.quant_tiled_linear(x, self.data, self.scales, mins,
                                              4 if self.spec.method == "int4" else 8)
        return out if bias is None else out + bias

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K] these integers stand for."""
        return self.dequantize_rows(None)

    def dequantize_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        """Rows `ids` (all rows for None) of the float32 weight: an embedding lookup."""
        if self.blocked and self._kernel is not None:
            # The tiled path's block decoders, the looked-up rows' blocks only: Python's
            # unblocking is ~25x slower for GGUF Q4_K / Q6_K, and its torch indexing took
            # ~6% of a one-client decode step of the default model (Q8_0) for one id
            rows = torch.arange(self.out_features) if ids is None else ids
            return self._kernel.blocked_rows(self.data, self.scales,
                                             _NO_TENSOR if self.mins is None else self.mins,
                                             rows.long(), 4 if self.spec.method == "int4" else 8)
        data, scales, mins = self.canonical(ids)
        n, k = data.shape[0], self.in_features
        segments = scales.shape[1]  # K / 32, or K / 16 (GGUF Q6_K's 16-column scales)
        if self.spec.method == "int8":
            q = data.view(n, segments, k // segments).float()
        else:
            q = unpack_int4(data).view(n, segments, k // segments).float()
        weight = q * scales.float().unsqueeze(-1)
        if mins is not None:
            weight = weight + mins.float().unsqueeze(-1)
        return weight.view(n, k)


_NO_TENSOR = torch.empty(0)


def can_quantize(out_features: int, in_features: int) -> bool:
    return in_features % GROUP_SIZE == 0


def quantize(weight: torch.Tensor, spec: QuantSpec, max_rows: int | None = None,
             dtype: torch.dtype | None = None) -> QuantizedWeight:
    """Quantize a float weight [N, K], round to nearest, per group of 32 columns.
    `max_rows` defaults to `default_max_rows` for the model's `dtype`.

    Scales and mins are rounded to float16 before the integers are computed from them.
    Values that already lie on such a grid (a dequantized GGUF Q4_0/Q4_1/Q8_0 tensor,
    whose scales are float16) come back exactly.
    """
    n, k = weight.shape
    if not can_quantize(n, k):
        raise ValueError(f"cannot quantize a [{n}, {k}] weight: K must be a multiple of 32")
    max_rows = default_max_rows(kernel_kind(spec, n), dtype) if max_rows is None else max_rows
    w = weight.detach().float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    if spec.method == "int8":
        # Worked example, a group [0.5, -1.27, 0.1, ...]: scale = 1.27 / 127 = 0.01,
        # q = round(w / scale) = [50, -127, 10, ...].
        scales = _half(w.abs().amax(dim=-1) / 127)
        q = torch.round(w / _nonzero(scales).unsqueeze(-1)).clamp(-127, 127)
        return QuantizedWeight(spec, q.to(torch.int8).view(n, k).contiguous(),
                               scales.half().contiguous(), None, max_rows)
    if spec.symmetric:
        # Q4_0: the value of largest magnitude v sits at q = 0, so scale = -v / 8.
        # Example, a group [0.8, -0.2, 0.4, ...]: scale = -0.1, q = round(w / scale) + 8
        # = [0, 10, 4, ...], and scale * (q - 8) = [0.8, -0.2, 0.4, ...].
        index = w.abs().argmax(dim=-1, keepdim=True)
        scales = _half(-w.gather(-1, index).squeeze(-1) / 8)
        q = torch.round(w / _nonzero(scales).unsqueeze(-1)) + 8
        mins = -8 * scales
    else:
        # Q4_1: example group [-0.3, 0.0, 0.45, ...] with min -0.3, max 0.45:
        # scale = 0.75 / 15 = 0.05, q = round((w - min) / scale) = [0, 6, 15, ...].
        mins = _half(w.amin(dim=-1))
        scales = _half((w.amax(dim=-1) - mins) / 15)
        q = torch.round((w - mins.unsqueeze(-1)) / _nonzero(scales).unsqueeze(-1))
    q = q.clamp(0, 15).to(torch.uint8).view(n, k)
    return QuantizedWeight(spec, pack_int4(q), scales.half().contiguous(),
                           mins.half().contiguous(), max_rows)


def _half(values: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to float16 (kept float32); too large for float16: an error."""
    rounded = values.half()
    if not torch.isfinite(rounded).all():
        raise ValueError("a weight group's scale or minimum exceeds float16's range (65504)")
    return rounded.float()


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    """Scales with 0 replaced by 1 for dividing (an all-zero group quantizes to q = 0)."""
    return torch.where(scales == 0, torch.ones_like(scales), scales)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> [N, K / 2]: per group of 32, byte j = q[j] | q[j + 16] << 4.

    Example, one group q = [0, 1, ..., 15, 15, 14, ..., 0]: byte 0 = 0 | 15 << 4 = 0xF0,
    byte 1 = 1 | 14 << 4 = 0xE1, ..., byte 15 = 15 | 0 << 4 = 0x0F.
    """
    n, k = q.shape
    groups = q.view(n, k // GROUP_SIZE, 2, GROUP_SIZE // 2)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [N, K / 2] -> uint8 [N, K]."""
    n, half = packed.shape
    groups = packed.view(n, half // (GROUP_SIZE // 2), 1, GROUP_SIZE // 2)
    return torch.cat([groups & 0x0F, groups >> 4], dim=2).reshape(n, half * 2)


def block_int4(data: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-major int4 ([N, K / 2], scales/mins [N, K / 32]) -> blocks of 16 output rows.

    The layout of pagedserve_kernels/cpu/quant_blocked.cpp (its header has the why): for block b,
    group g and quad t, 32 bytes where byte 2j holds q[16b + j, 32g + 4t] (low nibble)
    and q[.., 4t + 2] (high), byte 2j + 1 holds q[.., 4t + 1] and q[.., 4t + 3]; scales
    and mins [N / 16, K / 32, 16], lane j = row 16b + j. Worked example: if every row's
    group 0 starts q = (1, 2, 3, 4, ...), block 0 begins 0x31 0x42 0x31 0x42 ...
    """
    return block_int4_values(unpack_int4(data)), _group_lanes(scales), _group_lanes(mins)


def block_int4_values(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> block_int4's blocked bytes [N / 16, K / 32, 256]."""
    n, k = q.shape
    groups = k // GROUP_SIZE
    q = q.reshape(n // BLOCK_ROWS, BLOCK_ROWS, groups, 8, 4)
    q = q.permute(0, 2, 3, 1, 4)  # [block, group, quad, lane, 4 values]
    pairs = q[..., 0:2] | (q[..., 2:4] << 4)  # byte 2j: values 0 | 2, byte 2j + 1: 1 | 3
    return pairs.reshape(n // BLOCK_ROWS, groups, 256).contiguous()


SUPER_BLOCK_GROUPS = 8  # groups of 32 per K-quant super-block (256 columns)


def super_block_lanes(d: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per-segment values d[n, s] * k[n, i] in quant_blocked.cpp's super-block lanes.

    d: float16 [N, K / 256] (one per super-block s); k one per segment i of 32 columns
    (uint8 [N, K / 32], GGUF Q4_K) or of 16 (int8 [N, K / 16], GGUF Q6_K), 8 or 16 per
    super-block -> uint8 [N / 16, K / 256, 160 or 288]: per block b and super-block s, d of
    the 16 rows (float16, bytes 0..31), then the bytes of k[i][j] for segment i of s, lane
    j (row 16 b + j). Example: Q4_K's scales are d * sc (sc a 6-bit scale), its mins
    -dmin * m; d = 0.5 and k = 7 stand for 3.5, exactly (float32 holds the product).
    """
    n, supers = d.shape
    per_super = k.shape[1] // supers
    d_lanes = d.view(n // BLOCK_ROWS, BLOCK_ROWS, supers).transpose(1, 2)  # [B, S, 16]
    k_lanes = k.view(torch.uint8).view(n // BLOCK_ROWS, BLOCK_ROWS, supers, per_super)
    k_lanes = k_lanes.permute(0, 2, 3, 1)  # [B, S, segment, lane]
    d_bytes = d_lanes.contiguous().view(torch.uint8)  # [B, S, 32]
    return torch.cat([d_bytes, k_lanes.reshape(n // BLOCK_ROWS, supers, -1)], dim=-1).contiguous()


def _lane_values(lanes: torch.Tensor | None) -> torch.Tensor | None:
    """Blocked scales or mins as values [N / 16, segments, 16]: float16 as they are,
    super-block lanes expanded to float32 (d * k, exact; k signed in Q6_K's 16-column
    segments, unsigned in Q4_K's 32-column ones)."""
    if lanes is None or lanes.dtype != torch.uint8:
        return lanes
    blocks, supers = lanes.shape[0], lanes.shape[1]
    d = lanes[..., :2 * BLOCK_ROWS].contiguous().view(torch.float16).float()  # [B, S, 16]
    k = lanes[..., 2 * BLOCK_ROWS:].contiguous()
    per_super = k.shape[-1] // BLOCK_ROWS
    if per_super == 2 * SUPER_BLOCK_GROUPS:
        k = k.view(torch.int8)
    k = k.view(blocks, supers, per_super, BLOCK_ROWS).float()
    return (d.unsqueeze(2) * k).reshape(blocks, supers * per_super, BLOCK_ROWS)


def _group_lanes(per_group: torch.Tensor) -> torch.Tensor:
    """Scales or mins [N, K / 32] -> [N / 16, K / 32, 16] (lane j of block b = row 16b + j),
    the blocked layouts' order."""
    n, groups = per_group.shape
    return per_group.view(n // BLOCK_ROWS, BLOCK_ROWS, groups).transpose(1, 2).contiguous()


def unblock_int4(blocked: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `block_int4`, for output rows `ids` (all for None)."""
    blocks, groups = blocked.shape[0], blocked.shape[1]
    if ids is None:
        ids = torch.arange(blocks * BLOCK_ROWS)
    block, lane = ids // BLOCK_ROWS, ids % BLOCK_ROWS
    pairs = blocked.view(blocks, groups, 8, BLOCK_ROWS, 2)[block, :, :, lane]  # [R, G, 8, 2]
    q = torch.cat([pairs & 0x0F, pairs >> 4], dim=-1)  # values (0, 1, 2, 3) of each quad
    q = q.reshape(ids.numel(), groups * GROUP_SIZE)
    return pack_int4(q), _lane_rows(scales, ids), _lane_rows(mins, ids)


def _lane_rows(lanes: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocked per-lane values [N / 16, G, 16] (scales or mins) of output rows `ids`: [R, G]."""
    return lanes[ids // BLOCK_ROWS, :, ids % BLOCK_ROWS].contiguous()


def block_int8(data: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major int8 ([N, K], scales [N, K / 32]) -> blocks of 16 output rows.

    The layout of pagedserve_kernels/cpu/quant_blocked.cpp: for block b and group g, 512 bytes
    [pair p][lane j][2] where byte (p, j, i) = q[16b + j, 32g + 2p + i]; scales
    [N / 16, K / 32, 16], lane j = row 16b + j. Worked example: if every row's group 0
    starts q = (1, -2, 3, 4), block 0, group 0 begins 1 -2 1 -2 ... (32 bytes: pair 0 of
    rows 0..15), then 3 4 3 4 ... (pair 1).
    """
    n, k = data.shape
    groups = k // GROUP_SIZE
    q = data.view(n // BLOCK_ROWS, BLOCK_ROWS, groups, GROUP_SIZE // 2, 2)
    q = q.permute(0, 2, 3, 1, 4)  # [block, group, pair, lane, 2 values]
    blocked = q.reshape(n // BLOCK_ROWS, groups, BLOCK_ROWS * GROUP_SIZE).contiguous()
    return blocked, _group_lanes(scales)


Q6K_QUAD_BYTES = 48  # a quad of 16 rows x 4 six-bit weights


def block_q6k_values(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..63 [N, K] (GGUF Q6_K's q; the weight is q - 32) -> int8
    [N / 16, K / 32, 384], quant_blocked.cpp's Q6_K layout: per quad t of a group, the int8
    layout's 64 byte positions P = 32 p + 2 j + i (lane j, column 4 t + 2 p + i) in 48
    bytes: byte b < 32 holds P = b's low four bits | P = 32 + b's << 4, byte 32 + k the
    high two bits of P = k, 16 + k, 32 + k, 48 + k at bits 0, 2, 4, 6.
    Example: positions 0 and 32 holding 42 and 21 (weights 10 and -11): byte 0 = 0x5A,
    and byte 32 has 2 at bits 0-1 and 1 at bits 4-5.
    """
    n, k = q.shape
    groups = k // GROUP_SIZE
    cols = q.reshape(n // BLOCK_ROWS, BLOCK_ROWS, groups, 8, 2, 2)  # [B, j, G, t, p, i]
    positions = cols.permute(0, 2, 3, 4, 1, 5).reshape(n // BLOCK_ROWS, groups, 8, 64)
    low, top = positions & 0x0F, positions >> 4
    nibbles = low[..., :32] | (low[..., 32:] << 4)
    quarters = top.view(n // BLOCK_ROWS, groups, 8, 4, 16)  # P = 16 s + k
    high = (quarters[..., 0, :] | (quarters[..., 1, :] << 2) | (quarters[..., 2, :] << 4)
            | (quarters[..., 3, :] << 6))
    quads = torch.cat([nibbles, high], dim=-1)  # [B, G, 8, 48]
    return quads.reshape(n // BLOCK_ROWS, groups, 8 * Q6K_QUAD_BYTES).view(torch.int8).contiguous()


def int8_layout(blocked: torch.Tensor) -> torch.Tensor:
    """Blocked int8 weights as block_int8's layout (Q6_K's 6-bit layout decoded)."""
    if blocked.shape[2] != 8 * Q6K_QUAD_BYTES:
        return blocked
    quads = blocked.view(torch.uint8).view(blocked.shape[0], blocked.shape[1], 8, Q6K_QUAD_BYTES)
    nibbles, high = quads[..., :32], quads[..., 32:]
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
    top = torch.cat([(high >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-1)
    q = (low | (top << 4)).to(torch.int8) - 32
    return q.reshape(blocked.shape[0], blocked.shape[1], 512)


def unblock_int8(blocked: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `block_int8`, for output rows `ids` (all for None)."""
    blocks, groups = blocked.shape[0], blocked.shape[1]
    if ids is None:
        ids = torch.arange(blocks * BLOCK_ROWS)
    block, lane = ids // BLOCK_ROWS, ids % BLOCK_ROWS
    pairs = blocked.view(blocks, groups, GROUP_SIZE // 2, BLOCK_ROWS, 2)[block, :, :, lane]
    q = pairs.reshape(ids.numel(), groups * GROUP_SIZE)  # [R, G, 16 pairs, 2] -> [R, K]
    return q.contiguous(), _lane_rows(scales, ids)
