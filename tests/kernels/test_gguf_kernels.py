"""GGUF block formats served in place: the C++ decoders and linears against gguf-py's
`dequantize` + a float64 matmul, for every block type, on shapes with leftover rows
(M not a multiple of the 4-row blocks), partial tiles (N not a multiple of the tile)
and several blocks per row; and the int4/int8 tiled path against its dense reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import pagedserve_kernels.cpu_kernels
from engine.models.quant import QuantSpec, quantize
from tests.support.gguf_rows import random_gguf_rows

needs_kernels = pytest.mark.skipif(not pagedserve_kernels.cpu_kernels.toolchain_available(),
                                   reason="no C++ compiler/ninja to build the CPU kernels")
T = GGMLQuantizationType
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.IQ4_NL, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
         T.Q6_K, T.IQ4_XS, T.F16, T.BF16, T.F32]
def reference_linear(x: torch.Tensor, raw: np.ndarray, ggml_type) -> torch.Tensor:
    weight = torch.from_numpy(dequantize(raw, ggml_type).astype(np.float64))
    return x.double() @ weight.T


def tolerance(x: torch.Tensor, raw: np.ndarray, ggml_type) -> torch.Tensor:
    """What rounding x to int16 per group (1.5e-5 of a group's max |x|) and float32
    accumulation may cost: 1e-4 of sum |x| |w|, plus a floor for near-zero outputs."""
    weight = torch.from_numpy(dequantize(raw, ggml_type).astype(np.float64))
    return 1e-4 * (x.double().abs() @ weight.abs().T) + 1e-6


@needs_kernels
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_py(ggml_type):
    ops = pagedserve_kernels.cpu_kernels.cpu_kernels()
    raw = random_gguf_rows(ggml_type, 5, 512, seed=int(ggml_type))
    ours = ops.gguf_dequantize(torch.from_numpy(raw), int(ggml_type), 512)
    expected = torch.from_numpy(dequantize(raw, ggml_type).astype(np.float32))
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)


@needs_kernels
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 3, 6, 9])
def test_few_rows_path_matches_reference(ggml_type, num_rows):
    ops = pagedserve_kernels.cpu_kernels.cpu_kernels()
    cols, num_out = 768, 37  # three K-quant blocks per row; an odd number of outputs
    raw = random_gguf_rows(ggml_type, num_out, cols, seed=int(ggml_type) + num_rows)
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows))
    out = ops.gguf_linear(x, torch.from_numpy(raw), int(ggml_type), 64)
    error = (out.double() - reference_linear(x, raw, ggml_type)).abs()
    assert (error <= tolerance(x, raw, ggml_type)).all(), error.max()


@needs_kernels
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q5_0, T.Q3_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_path_matches_reference(ggml_type, dtype):
    ops = pagedserve_kernels.cpu_kernels.cpu_kernels()
    cols, num_out = 4096, 300  # tiles of 128 (float32) / 256 (bfloat16) rows: a partial last tile
    raw = random_gguf_rows(ggml_type, num_out, cols, seed=7)
    x = torch.randn(21, cols, generator=torch.Generator().manual_seed(3))
    out = ops.gguf_linear(x.to(dtype), torch.from_numpy(raw), int(ggml_type), 4)
    assert out.dtype == dtype
    expected = reference_linear(x.to(dtype).float(), raw, ggml_type)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)
    else:  # weights rounded to bfloat16 in the tile: about 2^-9 of each product
        error = (out.double() - expected).abs()
        assert (error <= 1e-2 * (x.abs().double() @ ops.gguf_dequantize(
            torch.from_numpy(raw), int(ggml_type), cols).abs().double().T) + 1e-3).all()


@needs_kernels
def test_few_rows_result_of_a_row_does_not_depend_on_its_batch():
    """The few-row path is batch invariant: row r alone and among 31 others, bitwise."""
    ops = pagedserve_kernels.cpu_kernels.cpu_kernels()
    for ggml_type in (T.Q4_K, T.Q6_K, T.Q5_K):
        raw = torch.from_numpy(random_gguf_rows(ggml_type, 64, 512, seed=1))
        x = torch.randn(32, 512, generator=torch.Generator().manual_seed(5))
        together = ops.gguf_linear(x, raw, int(ggml_type), 32)
        for r in (0, 5, 31):
            alone = ops.gguf_linear(x[r:r + 1].contiguous(), raw, int(ggml_type), 32)
            assert torch.equal(alone[0], together[r]), ggml_type.name


@needs_kernels
def test_bad_inputs_raise_before_any_work():
    ops = pagedserve_kernels.cpu_kernels.cpu_kernels()
    raw = torch.from_numpy(random_gguf_rows(T.Q4_K, 4, 256))
    with pytest.raises(RuntimeError, match=r"uint8 \[N, 288\]"):  # x has 512 columns
        ops.gguf_linear(torch.zeros(1, 512), raw, int(T.Q4_K), 8)
    with pytest.raises(RuntimeError, match="no decoder"):
        ops.gguf_linear(torch.zeros(1, 256), raw, 99, 8)
    with pytest.raises(RuntimeError, match="uint8"):
        ops.gguf_linear(torch.zeros(1, 256), raw[:, :100].contiguous(), int(T.Q4_K), 8)


@needs_kernels
@pytest.mark.parametrize("spec", [QuantSpec("int4"), QuantSpec("int4", symmetric=True),
                                  QuantSpec("int8")], ids=["int4", "int4-sym", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features", [130, 144])  # int4: row-major / blocks of 16
def test_quant_tiled_linear_matches_dequantized_weight(spec, dtype, out_features):
    ops = pagedserve_kernels.cpu_kernels.cpu_kernels()
    weight = torch.randn(out_features, 2048, generator=torch.Generator().manual_seed(2)) * 0.05
    q = quantize(weight, spec, max_rows=0)
    x = torch.randn(17, 2048, generator=torch.Generator().manual_seed(4)).to(dtype)
    mins = q.mins if q.mins is not None else torch.empty(0)
    out = ops.quant_tiled_linear(x, q.data, q.scales, mins, 4 if spec.method == "int4" else 8)
    expected = x @ q.dequantized().to(dtype).T
    torch.testing.assert_close(out, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


@needs_kernels
@pytest.mark.parametrize("ggml_type", [T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("activations", ["int16", "int8"])
def test_k_quant_repacked_into_blocked_layouts_matches_reference(ggml_type, activations):
    """GGUF Q3_K / Q4_K / Q5_K / Q6_K as the loader holds them (blocked int4 for Q4_K, six-bit
    int8 for the others, scales d * sc and Q4_K's and Q5_K's mins -dmin * m as super-block
    lanes): dequantized
    exactly as gguf-py (all rows and looked-up rows), the few-row kernel against the blocked
    kernels' arithmetic, batch invariant, the tiled path against the dense weight."""
    from engine.models.gguf_weight import repack
    from engine.models.quant import unpack_int4
    from pagedserve_kernels.cpu_kernels import activation_precision, set_activation_precision
    from pagedserve_kernels.reference import quant_linear_ref

    raw = random_gguf_rows(ggml_type, 48, 768, seed=11)
    w = repack(raw, ggml_type, max_rows=16)
    assert w.blocked and w.scale_form.startswith("super-blocks")
    # Q4_K: 148 bytes per 256 weights against the file's 144; Q6_K: 210, as the file;
    # Q5_K and Q3_K in Q6_K's six bits: 212 against 176, 210 against 110
    growth = {T.Q3_K: 1.95, T.Q5_K: 1.25}.get(ggml_type, 1.03)
    assert w.num_bytes <= growth * raw.nbytes
    dense = torch.from_numpy(dequantize(raw, ggml_type).astype(np.float32))
    assert torch.equal(w.dequantized(), dense)
    ids = torch.tensor([0, 17, 47, 17])
    assert torch.equal(w.dequantize_rows(ids), dense[ids])
    data, scales, mins = w.canonical()
    before = activation_precision()
    set_activation_precision(activations)
    try:
        for rows in (1, 3, 9, 16):
            x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
            out = w.matmul(x, None)
            q = unpack_int4(data) if ggml_type == T.Q4_K else data
            expected = quant_linear_ref(x, q, scales, mins, bits=8 if activations == "int8" else 16)
            torch.testing.assert_close(out, expected, atol=1e-3, rtol=1e-5)
            assert torch.equal(w.matmul(x[-1:].contiguous(), None)[0], out[-1])
    finally:
        set_activation_precision(before)
    x = torch.randn(40, 768, generator=torch.Generator().manual_seed(1))  # past max_rows: tiled
    torch.testing.assert_close(w.matmul(x, None), x @ dense.T, atol=1e-3, rtol=1e-5)


@needs_kernels
def test_super_block_lanes_of_the_wrong_shape_are_refused():
    from engine.models.gguf_weight import repack

    ops = pagedserve_kernels.cpu_kernels.cpu_kernels()
    w = repack(random_gguf_rows(T.Q4_K, 32, 512), T.Q4_K)
    x = torch.zeros(1, 512)
    with pytest.raises(RuntimeError, match="super-blocks"):
        ops.int4_linear(x, w.data, w.scales[:, :1].contiguous(), w.mins)
    with pytest.raises(RuntimeError, match="super-blocks"):
        ops.quant_tiled_linear(x, w.data, w.scales, w.mins[..., :100].contiguous(), 4)
    six = repack(random_gguf_rows(T.Q6_K, 32, 512), T.Q6_K)
    with pytest.raises(RuntimeError, match="whole groups"):  # Q6_K's scales on int4 weights
        ops.int4_linear(x, w.data, six.scales, w.mins)
    with pytest.raises(RuntimeError, match="384"):  # Q6_K's scales on 8-bit weights
        ops.int8_linear(x, torch.zeros(2, 16, 512, dtype=torch.int8), six.scales)
    with pytest.raises(RuntimeError, match="out of range"):  # an embedding row past N
        ops.blocked_rows(w.data, w.scales, w.mins, torch.tensor([32]), 4)
