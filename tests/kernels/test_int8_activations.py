"""8-bit activations (PAGEDSERVE_ACTIVATION_PRECISION=int8) in the few-row packed kernels.

Each kernel against a float64 reference with the SAME activation rounding: x rounded per
group to int8 (dx = max |x| / 127, as pagedserve_kernels/cpu/group32_activations.h and
pagedserve_kernels.reference.quantize_activations_ref do), x' = dx * xq, then x' @ W.T in float64
with W the format's dequantized weight. The kernels' integer dots are exact, so what is
left is float32 accumulation over groups: the tolerance is tight (1e-5). Rows are also
checked bitwise against the same rows run alone (batch invariance).

- the native build (pagedserve_kernels.cpu_kernels, -march=native) for blocked int4 (Q4_1 and Q4_0
  as int4), blocked int8 (Q8_0), the row-major int4/int8 kernels, and GGUF Q4_K / Q6_K
  (activations per 256, as llama.cpp's Q8_K; the int16 code takes the int8-valued xq);
- pagedserve_kernels/cpu/quant_blocked.cpp built for AVX-512 with VNNI, AVX-512 without VNNI, AVX2
  with AVX-VNNI, AVX2 alone and no SIMD (extended: ~40 s of compiling each).

The default model with int8 activations against transformers: tests/engine/test_default_model.py.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import pagedserve_kernels.cpu_kernels as ck
from engine.models.gguf_weight import repack
from engine.models.quant import QuantizedWeight, QuantSpec, quantize, unpack_int4
from pagedserve_kernels.reference import quantize_activations_ref
from tests.support.gguf_rows import T, random_gguf_rows

needs_kernels = pytest.mark.skipif(not ck.toolchain_available(),
                                   reason="no C++ compiler/ninja to build the CPU kernels")
SPECS = {"int4": QuantSpec("int4"), "int4-sym": QuantSpec("int4", symmetric=True),
         "int8": QuantSpec("int8")}
ROWS = (1, 2, 3, 8, 13)  # 13: a pass of 8 rows and one of 5


@contextmanager
def activation_precision(name: str):
    """The native kernels' precision set to `name` for the block, then restored."""
    before = ck.activation_precision()
    ck.set_activation_precision(name)
    try:
        yield
    finally:
        ck.set_activation_precision(before)


def rounded_activations(x: torch.Tensor, bits: int, group: int = 32) -> torch.Tensor:
    """x' = dx * xq (float64, exact) for x rounded per `group` to `bits` as the kernels do."""
    xq, dx, _ = quantize_activations_ref(x, group, bits)
    assert xq.abs().max() <= (127 if bits == 8 else 32767)
    return (xq.double() * dx.double().unsqueeze(-1)).reshape(x.shape)


def dequantized64(w: QuantizedWeight) -> torch.Tensor:
    """The weight these integers stand for, in float64 (float16 scales and mins exactly; a
    scale per 32 columns, or per 16 for GGUF Q6_K's repack)."""
    data, scales, mins = w.canonical()
    n, k = data.shape[0], w.in_features
    q = (unpack_int4(data) if w.spec.method == "int4" else data).double().view(n, scales.shape[1], -1)
    weight = q * scales.double().unsqueeze(-1)
    if mins is not None:
        weight = weight + mins.double().unsqueeze(-1)
    return weight.view(n, k)


def reference(x: torch.Tensor, w: QuantizedWeight, bits: int) -> torch.Tensor:
    return (rounded_activations(x, bits) @ dequantized64(w).T).float()


def run(linear, x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return linear(x, w.data, w.scales, w.mins)


def check_kernel(linear, w: QuantizedWeight, bits: int, seed: int = 0, atol: float = 1e-5) -> None:
    """`linear` (x, data, scales, mins) against the reference for every row count, and
    each row bitwise the same alone as in its batch."""
    gen = torch.Generator().manual_seed(seed)
    for rows in ROWS:
        x = torch.randn(rows, w.in_features, generator=gen)
        x[0, :32] *= 1e-3  # a group of small values: its own scale
        out = run(linear, x, w)
        torch.testing.assert_close(out, reference(x, w, bits), atol=atol, rtol=1e-5)
        for m in range(rows):
            assert torch.equal(run(linear, x[m:m + 1], w)[0], out[m]), (rows, m)


def native_linear(method: str):
    ops = ck.cpu_kernels()
    if method == "int4":
        return ops.int4_linear
    return lambda x, data, scales, mins: ops.int8_linear(x, data, scales)


@needs_kernels
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("out_features", [48, 40], ids=["blocked", "row-major"])
def test_native_kernels_match_the_reference(name, out_features):
    spec = SPECS[name]
    torch.manual_seed(1)
    w = quantize(torch.randn(out_features, 320) * 0.1, spec, max_rows=64)
    assert w.blocked == (out_features % 16 == 0)
    linear = native_linear(spec.method)
    ops = ck.cpu_kernels()
    # The row-major kernels are batch invariant with --batch-invariant only (one row takes
    # its own code otherwise); the blocked ones always are.
    ops.set_batch_invariant(not w.blocked)
    try:
        for precision, bits in ck.ACTIVATION_PRECISIONS.items():
            with activation_precision(precision):
                check_kernel(linear, w, bits)
    finally:
        ops.set_batch_invariant(False)


@needs_kernels
def test_int8_rounding_is_what_changes():
    """int8 and int16 differ by the rounding of x alone: each matches its own reference
    and not the other's (the switch takes effect on the next call)."""
    torch.manual_seed(2)
    w = quantize(torch.randn(64, 256) * 0.1, SPECS["int4"], max_rows=64)
    x = torch.randn(4, 256)
    outs = {}
    for precision in ck.ACTIVATION_PRECISIONS:
        with activation_precision(precision):
            outs[precision] = run(native_linear("int4"), x, w)
    gap = (outs["int8"] - outs["int16"]).abs().max().item()
    assert 1e-4 < gap < 0.1 * outs["int16"].abs().max().item()


def test_precision_from_the_environment(monkeypatch):
    monkeypatch.setenv(ck.ACTIVATION_PRECISION_ENV, "INT8 ")
    assert ck.activation_precision_from_env() == "int8"
    monkeypatch.setenv(ck.ACTIVATION_PRECISION_ENV, "")
    assert ck.activation_precision_from_env() == ck.default_activation_precision()
    monkeypatch.setenv(ck.ACTIVATION_PRECISION_ENV, "fp8")
    with pytest.raises(ValueError, match="int16, int8"):
        ck.activation_precision_from_env()
    with pytest.raises(ValueError):
        ck.set_activation_precision("int4")


# ---- GGUF K-quants: activations per 256 (Q8_K-like) ----

def random_k_quant_rows(ggml_type, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: random Q4_K / Q6_K blocks with moderate float16 d (and dmin)."""
    from gguf import GGML_QUANT_SIZES

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in ([0, 2] if ggml_type.name == "Q4_K" else [208]):
        halves = rng.uniform(0.002, 0.02, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, cols // block * size)


def gguf_reference(x: torch.Tensor, raw: np.ndarray, ggml_type, bits: int) -> torch.Tensor:
    from gguf.quants import dequantize

    weight = torch.from_numpy(dequantize(raw, ggml_type).astype(np.float64))
    return (rounded_activations(x, bits, group=256) @ weight.T).float()


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_gguf_k_quants_match_the_reference(type_name):
    from gguf import GGMLQuantizationType

    ggml_type = GGMLQuantizationType[type_name]
    raw = random_k_quant_rows(ggml_type, 40, 512, seed=3)
    ops = ck.cpu_kernels()
    gen = torch.Generator().manual_seed(4)
    for precision, bits in ck.ACTIVATION_PRECISIONS.items():
        with activation_precision(precision):
            for rows in ROWS:
                x = torch.randn(rows, 512, generator=gen)
                out = ops.gguf_linear(x, torch.from_numpy(raw), int(ggml_type), 1 << 30)
                expected = gguf_reference(x, raw, ggml_type, bits)
                scale = expected.abs().max().item()
                torch.testing.assert_close(out, expected, atol=1e-5 * scale, rtol=1e-5)
                for m in range(rows):
                    alone = ops.gguf_linear(x[m:m + 1], torch.from_numpy(raw), int(ggml_type),
                                            1 << 30)
                    assert torch.equal(alone[0], out[m])


# ---- quant_blocked.cpp built for each instruction set ----

BINDING = r"""
#include <torch/extension.h>
#include "group32_activations.h"
at::Tensor blocked_int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins);
at::Tensor blocked_int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins);
at::Tensor linear(at::Tensor x, at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> mins,
                  int64_t bits) {
  pagedserve::group32::set_activation_bits(static_cast<int>(bits));
  if (packed.scalar_type() == at::kByte) return blocked_int4_linear(x, packed, scales, *mins);
  return blocked_int8_linear(x, packed, scales, mins ? *mins : at::Tensor());
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear", &linear); }
"""
_BASE = ["-O2", "-mavx2", "-mfma", "-mf16c"]
_AVX512 = _BASE + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
# build -> (compiler flags, the CPU flags it needs to run)
ISA_BUILDS = {
    "avx512-vnni": (_AVX512 + ["-mavx512vnni"], {"avx512f", "avx512bw", "avx512_vnni"}),
    "avx512-no-vnni": (_AVX512, {"avx512f", "avx512bw"}),
    "avx2-avx-vnni": (_BASE + ["-mavxvnni"], {"avx2", "avx_vnni"}),
    "avx2": (_BASE, {"avx2"}),
    "portable": (["-O2", "-mno-avx"], set()),
}


@pytest.mark.extended
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("isa", list(ISA_BUILDS))
def test_blocked_isa_builds_match_the_reference(isa, tmp_path):
    from engine import cpu_info
    from tests.support.isa_builds import build_for_isa

    cflags, needs = ISA_BUILDS[isa]
    if not needs <= cpu_info.cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_info.cpu_flags())}")
    ext = build_for_isa(f"pagedserve_x8_blocked_{isa.replace('-', '_')}", "quant_blocked.cpp",
                        BINDING, cflags, tmp_path)
    torch.manual_seed(0)
    weights = {name: quantize(torch.randn(48, 320) * 0.1, spec, max_rows=64)
               for name, spec in SPECS.items()}
    for ggml_type in (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):  # GGUF K-quants repacked into the blocked layouts
        weights[ggml_type.name] = repack(random_gguf_rows(ggml_type, 48, 512, seed=2), ggml_type)
    for name, w in weights.items():
        # random K-quant blocks hold weights up to ~19 (float32 sums: a larger absolute error)
        atol = 1e-4 if name.endswith("_K") else 1e-5
        for bits in (8, 16):
            check_kernel(lambda x, data, scales, mins, b=bits: ext.linear(x, data, scales, mins, b),
                         w, bits, seed=len(name), atol=atol)


# ---- The row tiles of many-row calls, the CPU default, --activation-precision ----

@needs_kernels
@pytest.mark.parametrize("name", ["int4", "int8"])
def test_row_tiles_cover_every_row(name):
    """Many rows over a long K run in tiles of rows (~256 KB of rounded activations: 32 rows
    of int8 or 16 of int16 at K = 8,192): every row of a 45-row batch, across three tiles and
    a partial one, against the reference at both precisions, and bitwise as the row alone."""
    torch.manual_seed(1)
    w = quantize(torch.randn(32, 8192) * 0.05, SPECS[name], max_rows=1 << 30)
    x = torch.randn(45, 8192)
    for precision, bits in ck.ACTIVATION_PRECISIONS.items():
        with activation_precision(precision):
            out = run(native_linear(name), x, w)
            torch.testing.assert_close(out, reference(x, w, bits), atol=1e-4, rtol=1e-5)
            for m in (0, 15, 16, 31, 32, 44):
                assert torch.equal(run(native_linear(name), x[m:m + 1], w)[0], out[m]), (bits, m)


def test_default_precision_follows_avx512_vnni(monkeypatch):
    """int8 where the CPU has AVX-512 VNNI (vpdpbusd), int16 elsewhere (AVX-VNNI included:
    not measured there)."""
    cases = {"fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16": "int8",
             "fpu avx2 avx512f avx512bw avx512_bf16": "int16",
             "fpu avx2 avx_vnni": "int16", "": "int16"}
    for flags, expected in cases.items():
        monkeypatch.setattr(ck, "_cpu_flags_line", lambda f=flags: f"flags\t\t: {f}")
        assert ck.default_activation_precision() == expected, flags
