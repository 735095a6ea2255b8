"""The CPU paged-attention kernel's AVX2 and portable builds.

The server builds kernels/cpu/ with -march=native, so one machine runs one version of
kernels/cpu/paged_attention.cpp (AVX-512: 4-vector value tiles; AVX2: 2-vector tiles and
16 registers; no SIMD: the vector extension's plain loops). Here the file is also built
for AVX2 only and for no SIMD at all, and checked against the reference and for bitwise
batch invariance (each row alone equals the row inside its request's run). Two extra
compiles (~30 s each): extended.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kernels.reference import paged_attention_ref, reshape_and_cache_ref
from tests.test_kernels import make_batch

KERNELS = Path(__file__).resolve().parents[1] / "kernels" / "cpu"
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
    from torch.utils.cpp_extension import load

    binding = tmp_path / "binding.cpp"
    binding.write_text(BINDING)
    ext = load(name=f"pagedserve_paged_attention_{isa}",
               sources=[str(binding), str(KERNELS / "paged_attention.cpp")],
               extra_cflags=FLAGS[isa] + ["-fopenmp"], extra_include_paths=[str(KERNELS)],
               build_directory=str(tmp_path))
    specs = [(0, 20), (19, 8), (40, 3), (100, 1)]  # chunks, a verify step's rows, a decode
    for num_heads, num_kv_heads, head_size in ((9, 3, 64), (4, 4, 80)):
        batch = make_batch(specs, num_heads, num_kv_heads, head_size, 16, num_pad=0, seed=4)
        reshape_and_cache_ref(batch.key, batch.value, batch.kv_cache, batch.slot_mapping)
        for cache_dtype in (torch.float32, torch.bfloat16):
            head_major = batch.kv_cache.permute(0, 3, 1, 2, 4).contiguous().to(cache_dtype)
            row_tables = torch.cat([torch.full((q,), r, dtype=torch.int32)
                                    for r, (_, q) in enumerate(specs)])
            row_lens = torch.cat([torch.arange(ctx + 1, ctx + q + 1, dtype=torch.int32)
                                  for ctx, q in specs])
            scale = head_size**-0.5
            for window in (0, 5):
                out = torch.full_like(batch.query, float("nan"))
                ext.paged_attention(out, batch.query, head_major, batch.block_table,
                                    row_tables, row_lens, scale, window)
                expected = paged_attention_ref(
                    batch.query, batch.kv_cache.to(cache_dtype).float(), batch.block_table,
                    batch.query_start_loc, batch.seq_lens, scale, sliding_window=window or None)
                torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
                for row in range(len(row_tables)):
                    alone = torch.empty_like(batch.query[row:row + 1])
                    ext.paged_attention(alone, batch.query[row:row + 1].contiguous(), head_major,
                                        batch.block_table, row_tables[row:row + 1].contiguous(),
                                        row_lens[row:row + 1].contiguous(), scale, window)
                    assert torch.equal(alone, out[row:row + 1]), (isa, row)
