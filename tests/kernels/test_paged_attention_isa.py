"""The CPU paged-attention kernel's AVX2 and portable builds.

The server builds pagedserve_kernels/cpu/ with -march=native, so one machine runs one version of
pagedserve_kernels/cpu/paged_attention.cpp (AVX-512: 4-vector value tiles; AVX2: 2-vector tiles and
16 registers; no SIMD: the vector extension's plain loops). Here the file is also built
for AVX2 only and for no SIMD at all, and checked as the native build is
(tests/kernels/test_attention_kernels.py `check_rows_batch_invariant`: the reference, and each row alone
equal to the row inside its request's run or a shuffled batch). Two extra
compiles (~30 s each): extended.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.attention_cases import check_rows_batch_invariant
from tests.support.isa_builds import build_for_isa

BINDING = r"""
#include <torch/extension.h>
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                     at::Tensor block_table, at::Tensor row_tables, at::Tensor seq_lens,
                     double scale, int64_t sliding_window);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_attention", &paged_attention); }
"""
FLAGS = {"avx2": ["-O2", "-mavx2", "-mfma", "-mf16c"], "portable": ["-O2", "-mno-avx"]}


@pytest.mark.extended
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("isa", sorted(FLAGS))
def test_attention_builds_match_the_reference(isa, tmp_path):
    ext = build_for_isa(f"pagedserve_paged_attention_{isa}", "paged_attention.cpp", BINDING,
                        FLAGS[isa], tmp_path)
    for num_heads, num_kv_heads, head_size in ((9, 3, 64), (4, 4, 80)):
        for cache_dtype in (torch.float32, torch.bfloat16):
            for window in (0, 5):
                check_rows_batch_invariant(ext.paged_attention, num_heads, num_kv_heads,
                                           head_size, cache_dtype, window)
