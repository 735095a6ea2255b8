"""Linear weights in GGUF block formats, held as the file's own bytes (no dense copy).

A loaded GGUF tensor becomes one of two packed weights, chosen by its GGML type:

    Q4_0, Q4_1, Q8_0, Q5_0, IQ4_NL  -> QuantizedWeight (engine.models.quant), repacked once
                                       at load and exact: a 32-block's float16 d (and m)
                                       become the group's scale (and min), its integers
                                       the group's q (Q5_0: q - 16, IQ4_NL: its table's
                                       value, both in int8), the same bytes per weight or
                                       fewer (Q5_0/IQ4_NL in int8: 1.06 vs 0.69/0.56)
    Q4_K (N a multiple of 16)       -> QuantizedWeight int4 in blocks of 16 rows, exact: the
                                       nibbles as they are, each group's scale d * sc and
                                       min -dmin * m kept as super-block lanes (float16 d,
                                       uint8 6-bit sc, m: 0.58 bytes per weight vs 0.5625),
                                       so the blocked int4 kernels run it (about twice the
                                       speed of gguf_linear.cpp's Q4_K kernel)
    Q6_K (N a multiple of 16)       -> QuantizedWeight int8 in blocks of 16 rows, exact: q - 32
                                       in six bits (block_q6k_values, the file's 0.82 bytes
                                       per weight), int8 scales per 16 columns as super-block
                                       lanes; the blocked int8 kernels decode it per group
    Q3_K (N a multiple of 16)       -> Q6_K's form, exact: q in -4..3 as six bits, d * (sc - 32)
                                       per 16 columns (0.82 bytes per weight vs 0.43)
    Q5_K (N a multiple of 16)       -> QuantizedWeight int8 in blocks of 16 rows, exact: q in
                                       0..31 in Q6_K's six bits with Q4_K's scale and min
                                       lanes (the int8 kernels' mins term; 0.83 bytes per
                                       weight vs 0.69)
    every other supported type      -> GGUFWeight: the memory-mapped bytes as they are
      (Q2_K, Q5_1, IQ4_XS; K-quants    in the file, multiplied by pagedserve_kernels/cpu/gguf_linear.cpp
       with other N)

A merged linear (qkv, gate_up) whose pieces have different types (Q4_K_M stores some
attn_v in Q6_K beside a Q4_K attn_q) holds a StackedWeight: each piece its own packed
weight, their outputs side by side. Pieces that repack to the same int4/int8 spec are
concatenated into one QuantizedWeight instead (so SmolLM2's Q4_1 qkv stays one kernel
call and the fused decoder stack can take it).

Every packed weight answers `matmul(x, bias)` for any number of rows, `dequantize_rows`
(an embedding lookup decodes only the rows it needs), `num_bytes` and `max_rows`.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine import batch_invariant
from engine.models.quant import (
    BLOCK_ROWS,
    GROUP_SIZE,
    KERNEL_CALLS,
    QuantizedWeight,
    QuantSpec,
    block_int4_values,
    block_q6k_values,
    default_max_rows,
    kernel_kind,
    super_block_lanes,
)

T = GGMLQuantizationType
_IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                        113], dtype=np.int8)
# The types that repack exactly, and the int4/int8 spec each becomes (the K-quants only
# with a multiple of 16 rows: `repacks`).
REPACKED_SPECS = {T.Q4_0: QuantSpec("int4", symmetric=True), T.Q4_1: QuantSpec("int4"),
                  T.Q8_0: QuantSpec("int8"), T.Q5_0: QuantSpec("int8"),
                  T.IQ4_NL: QuantSpec("int8"), T.Q4_K: QuantSpec("int4"),
                  T.Q3_K: QuantSpec("int8"), T.Q5_K: QuantSpec("int8"),
                  T.Q6_K: QuantSpec("int8")}


def repacks(ggml_type: GGMLQuantizationType, rows: int) -> bool:
    """Whether a tensor of this type and number of rows (output features) is repacked."""
    return ggml_type in REPACKED_SPECS and (ggml_type not in (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
                                            or rows % BLOCK_ROWS == 0)


def _kernels():
    from pagedserve_kernels.cpu_kernels import cpu_kernels

    return cpu_kernels()


class GGUFWeight:
    """One weight [N, K] in a GGUF block format: `raw` uint8 [N, row_bytes], read in place."""

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, in_features: int,
                 max_rows: int | None = None, dtype: torch.dtype | None = None):
        self.raw = raw
        self.ggml_type = ggml_type
        self.out_features = raw.shape[0]
        self.in_features = in_features
        self.max_rows = default_max_rows("gguf", dtype) if max_rows is None else max_rows
        self._kernel = _kernels()

    def tensors(self) -> list[torch.Tensor]:
        return [self.raw]

    @property
    def num_bytes(self) -> int:
        return self.raw.numel()

    def serves(self, num_rows: int) -> bool:
        return num_rows <= self.max_rows or batch_invariant.enabled()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x if x.is_contiguous() else x.contiguous()
        if self._kernel is None:
            out = torch.nn.functional.linear(x, self.dequantized().to(x.dtype))
        else:
            few = self.serves(x.shape[0])
            KERNEL_CALLS[self.ggml_type.name if few else "tiled"] += 1
            out = self._kernel.gguf_linear(x, self.raw, int(self.ggml_type),
                                           x.shape[0] if few else self.max_rows)
        return out if bias is None else out + bias

    def dequantize_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        raw = self.raw if ids is None else self.raw[ids]
        if self._kernel is not None:
            return self._kernel.gguf_dequantize(raw.contiguous(), int(self.ggml_type),
                                                self.in_features)
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(raw.numpy(), self.ggml_type).astype(np.float32))

    def dequantized(self) -> torch.Tensor:
        return self.dequantize_rows(None)


class StackedWeight:
    """Packed weights stacked along the output dim: [parts[0] rows | parts[1] rows | ...]."""

    def __init__(self, parts: list):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self.max_rows = min(p.max_rows for p in parts)

    def tensors(self) -> list[torch.Tensor]:
        return [tensor for part in self.parts for tensor in part.tensors()]

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parts)

    def serves(self, num_rows: int) -> bool:
        return all(p.serves(num_rows) for p in self.parts)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.cat([p.matmul(x, None) for p in self.parts], dim=-1)
        return out if bias is None else out + bias

    def dequantize_rows(self, ids: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError("a stacked weight is never an embedding table")

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


def repack(raw: np.ndarray, ggml_type: GGMLQuantizationType, max_rows: int | None = None,
           dtype: torch.dtype | None = None) -> QuantizedWeight:
    """A GGUF tensor of a REPACKED_SPECS type (uint8 [N, K / block * block_bytes]) as an exact
    QuantizedWeight (Q4_K / Q6_K: `_repack_q4k`, `_repack_q6k`).

    Example, one Q4_1 block [d, m, qs[16]]: scales = d, mins = m, and the packed bytes are
    qs as they are (the low nibble of byte j is element j, the high nibble j + 16: the
    int4 packing of engine.models.quant). Q4_0: mins = -8 d (exact in float16 below
    2^12). Q5_0: q = (low nibble | fifth bit from qh) - 16 in int8, scale d.
    """
    spec = REPACKED_SPECS[ggml_type]
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, GGML_QUANT_SIZES[ggml_type][1])
    groups = blocks.shape[1]
    if max_rows is None:
        kind = "q6k-blocked" if ggml_type in (T.Q3_K, T.Q5_K, T.Q6_K) else kernel_kind(spec, n)
        max_rows = default_max_rows(kind, dtype)
    if ggml_type == T.Q4_K:
        return _repack_q4k(blocks, spec, max_rows)
    if ggml_type == T.Q3_K:
        return _repack_q3k(blocks, spec, max_rows)
    if ggml_type == T.Q5_K:
        return _repack_q5k(blocks, spec, max_rows)
    if ggml_type == T.Q6_K:
        return _repack_q6k(blocks, spec, max_rows)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, groups)
    if ggml_type in (T.Q4_0, T.Q4_1):
        qs = np.ascontiguousarray(blocks[..., -16:]).reshape(n, groups * 16)
        if ggml_type == T.Q4_1:
            mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(n, groups)
        else:
            mins = (d.astype(np.float32) * -8).astype(np.float16)
        return QuantizedWeight(spec, torch.from_numpy(qs), torch.from_numpy(d.copy()),
                               torch.from_numpy(mins.copy()), max_rows)
    if ggml_type == T.Q8_0:
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, groups * GROUP_SIZE)
    else:
        qs = blocks[..., -16:]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, groups, 32]
        if ggml_type == T.IQ4_NL:
            q = _IQ4_VALUES[nibbles]
        else:
            qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [n, groups, 1]
            high = (qh >> np.arange(32, dtype=np.uint32)) & 1
            q = (nibbles | (high.astype(np.uint8) << 4)).astype(np.int8) - 16
        q = np.ascontiguousarray(q.reshape(n, groups * GROUP_SIZE).astype(np.int8))
    return QuantizedWeight(spec, torch.from_numpy(q), torch.from_numpy(d.copy()), None, max_rows)


def _k4_scales_and_mins(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K blocks from their 12 bytes b [..., 12]
    (see _repack_q4k)."""
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _repack_q5k(blocks: np.ndarray, spec: QuantSpec, max_rows: int) -> QuantizedWeight:
    """Q5_K blocks (uint8 [N, K / 256, 176]: half d, dmin | scales[12] | qh[32] | qs[128]) as
    blocked int8 q (0..31) in Q6_K's six bits with Q4_K's super-block lanes for the scales
    d * sc and mins -dmin * m, exactly (0.83 bytes per weight against the file's 0.69). Element
    32 i + l of a block (group i) is the low (i even) or high (i odd) nibble of
    qs[32 (i // 2) + l] with bit i of qh[l] above it. Example: qs[0] = 0x5A, qh[0] = 0x02:
    element 0 is 0xA (bit 0 clear), element 32 0x5 | 1 << 4 = 21.
    """
    n, supers = blocks.shape[0], blocks.shape[1]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, supers)
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(n, supers)
    sc, m = _k4_scales_and_mins(blocks[..., 4:16])
    qh = blocks[..., 16:48].reshape(n, supers, 1, 32)
    qs = blocks[..., 48:].reshape(n, supers, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, supers, 8, 32)
    bits = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = (low | (((qh >> bits) & 1) << 4)).reshape(n, supers * 256)
    groups = supers * 8
    return QuantizedWeight(
        spec, block_q6k_values(torch.from_numpy(q + 32)),  # six bits hold q + 32
        super_block_lanes(torch.from_numpy(d), torch.from_numpy(sc.reshape(n, groups))),
        super_block_lanes(torch.from_numpy(-dmin), torch.from_numpy(m.reshape(n, groups))),
        max_rows)


def _repack_q4k(blocks: np.ndarray, spec: QuantSpec, max_rows: int) -> QuantizedWeight:
    """Q4_K blocks (uint8 [N, K / 256, 144]: half d, dmin | scales[12] | qs[128]) as blocked
    int4 with super-block lanes. Element 64 c + l (l < 32) of a block is the low nibble of
    qs[32 c + l], element 64 c + 32 + l its high nibble; group j's 6-bit scale and min
    unpack from the 12 bytes b as gguf_blocks.h's unpack_k4_scales:
        j < 4:  sc = b[j] & 63,                       m = b[j + 4] & 63
        j >= 4: sc = b[j + 4] & 15 | (b[j - 4] >> 6) << 4,  m = b[j + 4] >> 4 | (b[j] >> 6) << 4
    Example: b[0] = 0xC5, b[8] = 0x2A: sc[0] = 5, sc[4] = 0xA | 3 << 4 = 58.
    """
    n, supers = blocks.shape[0], blocks.shape[1]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(n, supers)
    dmin = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(n, supers)
    sc, m = _k4_scales_and_mins(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(n, supers, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, supers * 256)
    groups = supers * 8
    return QuantizedWeight(
        spec, block_int4_values(torch.from_numpy(q)),
        super_block_lanes(torch.from_numpy(d), torch.from_numpy(sc.reshape(n, groups))),
        super_block_lanes(torch.from_numpy(-dmin), torch.from_numpy(m.reshape(n, groups))),
        max_rows)


def _repack_q6k(blocks: np.ndarray, spec: QuantSpec, max_rows: int) -> QuantizedWeight:
    """Q6_K blocks (uint8 [N, K / 256, 210]: ql[128] | qh[64] | int8 scales[16] | half d) as
    blocked int8 q - 32 held in six bits (block_q6k_values) with super-block lanes of 16
    signed scales. Per half h of 128,
    element 32 t + l takes the low (t = 0, 1) or high (t = 2, 3) nibble of
    ql[64 h + 32 (t % 2) + l] and bits 2t, 2t + 1 of qh[32 h + l] above it; element e's
    scale is scales[e // 16]. Example: ql[0] = 0x5A, qh[0] = 0x12: element 0 is
    0xA | 2 << 4 = 42 (value 10), element 64 0x5 | 1 << 4 = 21 (bits 4, 5: value -11).
    """
    n, supers = blocks.shape[0], blocks.shape[1]
    ql = blocks[..., :128].reshape(n, supers, 2, 1, 2, 32)  # [h, -, t % 2, l]
    qh = blocks[..., 128:192].reshape(n, supers, 2, 1, 32)  # [h, -, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, supers, 2, 4, 32)  # [h, t, l]
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)
    q = low | (((qh >> shifts) & 3) << 4)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).reshape(n, supers * 16)
    d = np.ascontiguousarray(blocks[..., 208:210]).view(np.float16).reshape(n, supers)
    return QuantizedWeight(spec, block_q6k_values(torch.from_numpy(q.reshape(n, supers * 256))),
                           super_block_lanes(torch.from_numpy(d), torch.from_numpy(scales)),
                           None, max_rows)


def _repack_q3k(blocks: np.ndarray, spec: QuantSpec, max_rows: int) -> QuantizedWeight:
    """Q3_K blocks (uint8 [N, K / 256, 110]: hmask[32] | qs[64] | scales[12] | half d) in
    Q6_K's form: values q in -4..3 held in six bits as q + 32 (block_q6k_values: 0.82 bytes
    per weight against the file's 0.43), the signed scales sc - 32 per 16 columns as
    super-block lanes with d, exactly. Element 128 h + 32 s + l takes bits 2s, 2s + 1 of
    qs[32 h + l], minus 4 unless bit (4 h + s) of hmask[l] is set; sc[i] is the low nibble
    of scales[i % 8] (i < 8) or its high one (i >= 8), with bits 2 (i // 4) .. of
    scales[8 + i % 4] above it, as gguf-py reads them. Example: qs[0] = 0x07, hmask[0] =
    0x01: element 0 is 3 (bit set), element 32 is 1 - 4 = -3.
    """
    n, supers = blocks.shape[0], blocks.shape[1]
    hmask = blocks[..., :32].reshape(n, supers, 1, 32)
    qs = blocks[..., 32:96].reshape(n, supers, 2, 1, 32)
    packed = blocks[..., 96:108]
    d = np.ascontiguousarray(blocks[..., 108:110]).view(np.float16).reshape(n, supers)
    low = (packed[..., :8].reshape(n, supers, 1, 8)
           >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)).reshape(n, supers, 16)
    high = (packed[..., 8:].reshape(n, supers, 1, 4)
            >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, supers, 16)
    sc = (((low & 0x0F) | ((high & 3) << 4)).astype(np.int16) - 32).astype(np.int8)
    two = ((qs >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3)
    top = (hmask >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = two.reshape(n, supers, 8, 32).astype(np.int16) - 4 * (1 - top.astype(np.int16))
    stored = (q + 32).astype(np.uint8).reshape(n, supers * 256)
    return QuantizedWeight(spec, block_q6k_values(torch.from_numpy(stored)),
                           super_block_lanes(torch.from_numpy(d),
                                             torch.from_numpy(sc.reshape(n, supers * 16))),
                           None, max_rows)


def concat_quantized(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """QuantizedWeights of one spec and scale form stacked along the output dim, as one
    weight (blocked parts: their blocks one after another)."""
    if len(parts) == 1:
        return parts[0]
    if all(p.blocked for p in parts):
        tensors = zip(*((p.data, p.scales, p.mins) for p in parts), strict=True)
        data, scales, mins = (None if t[0] is None else torch.cat(t) for t in tensors)
        return QuantizedWeight(parts[0].spec, data, scales, mins, parts[0].max_rows)
    data, scales, mins = zip(*(p.canonical() for p in parts), strict=True)
    return QuantizedWeight(parts[0].spec, torch.cat(data), torch.cat(scales),
                           None if mins[0] is None else torch.cat(mins), parts[0].max_rows)
