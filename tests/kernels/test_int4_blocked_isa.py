"""The blocked int4 / int8 kernels' AVX2, AVX-512-without-VNNI and portable builds.

The server builds pagedserve_kernels/cpu/ with -march=native, so one machine runs one version of
pagedserve_kernels/cpu/quant_blocked.cpp (AVX-512 with or without VNNI, AVX2, portable). Here the file
is also built for AVX2 only, AVX-512 without VNNI and no SIMD at all, and checked against
the reference, bitwise batch invariance and the tiled path's block decoders included, for
float16 scales and for GGUF Q4_K's and Q6_K's super-block layouts.
Three extra compiles (~40 s each): extended.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from engine.models.gguf_weight import repack
from engine.models.quant import QuantSpec, quantize, unpack_int4
from pagedserve_kernels.reference import quant_linear_ref
from tests.support.gguf_rows import random_gguf_rows
from tests.support.isa_builds import build_for_isa

BINDING = r"""
#include <torch/extension.h>
at::Tensor blocked_int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins);
at::Tensor blocked_int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins);
void decode_blocked_int4(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst);
void decode_blocked_int8(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst);
at::Tensor linear(at::Tensor x, at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> mins) {
  if (packed.scalar_type() == at::kByte) return blocked_int4_linear(x, packed, scales, *mins);
  return blocked_int8_linear(x, packed, scales, mins ? *mins : at::Tensor());
}
at::Tensor decode_all(at::Tensor packed, at::Tensor scales, c10::optional<at::Tensor> mins) {
  const int64_t blocks = packed.size(0), cols = packed.size(1) * 32;
  at::Tensor out = at::empty({blocks * 16, cols}, at::kFloat);
  for (int64_t b = 0; b < blocks; ++b) {
    float* dst = out.data_ptr<float>() + b * 16 * cols;
    if (packed.scalar_type() == at::kByte) decode_blocked_int4(packed, scales, *mins, b, dst);
    else decode_blocked_int8(packed, scales, mins ? *mins : at::Tensor(), b, dst);
  }
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear);
  m.def("decode_all", &decode_all);
}
"""
FLAGS = {"avx2": ["-O2", "-mavx2", "-mfma", "-mf16c"], "portable": ["-O2", "-mno-avx"],
         # AVX-512 without VNNI (madd + add instead of vpdpwssd); runs where avx512bw does
         "avx512-no-vnni": ["-O2", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                            "-mavx512vl", "-mavx512dq"]}


@pytest.mark.extended
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("isa", sorted(FLAGS))
def test_blocked_builds_match_the_reference(isa, tmp_path):
    from engine import cpu_info

    if isa.startswith("avx512") and not {"avx512f", "avx512bw"} <= cpu_info.cpu_flags():
        pytest.skip("this CPU has no AVX-512")

    ext = build_for_isa(f"pagedserve_quant_blocked_{isa.replace('-', '_')}",
                        "quant_blocked.cpp", BINDING, FLAGS[isa], tmp_path)
    torch.manual_seed(0)
    for spec in (QuantSpec("int4"), QuantSpec("int4", symmetric=True), QuantSpec("int8")):
        w = quantize(torch.randn(48, 320) * 0.1, spec, max_rows=64)
        assert w.blocked
        data, scales, mins = w.canonical()
        q = unpack_int4(data) if spec.method == "int4" else data
        for rows in (1, 3, 8, 13):  # 13: passes of 8 and 5 rows
            x = torch.randn(rows, 320)
            out = ext.linear(x, w.data, w.scales, w.mins)
            expected = quant_linear_ref(x, q, scales, mins)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            for m in range(rows):
                assert torch.equal(ext.linear(x[m:m + 1], w.data, w.scales, w.mins)[0], out[m])
        torch.testing.assert_close(ext.decode_all(w.data, w.scales, w.mins), w.dequantized(),
                                   atol=1e-6, rtol=1e-6)
    # GGUF Q4_K / Q5_K / Q6_K repacked: super-block scales (d * sc, -dmin * m), Q6_K's six bits
    for ggml_type in (T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        raw = random_gguf_rows(ggml_type, 48, 512, seed=3)
        w = repack(raw, ggml_type, max_rows=64)
        data, scales, mins = w.canonical()
        q = unpack_int4(data) if ggml_type == T.Q4_K else data
        for rows in (1, 3, 8, 13):
            x = torch.randn(rows, 512)
            out = ext.linear(x, w.data, w.scales, w.mins)
            torch.testing.assert_close(out, quant_linear_ref(x, q, scales, mins),
                                       atol=1e-3, rtol=1e-5)
            assert torch.equal(ext.linear(x[-1:], w.data, w.scales, w.mins)[0], out[-1])
        assert torch.equal(ext.decode_all(w.data, w.scales, w.mins),
                           torch.from_numpy(dequantize(raw, ggml_type).astype(np.float32)))
