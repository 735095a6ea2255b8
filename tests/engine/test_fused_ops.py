"""The fused C++ CPU ops against their torch references (engine/models, torch backend)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backends.torch_backend import write_to_kv_cache_torch
from engine.models.layers import RMSNorm, SiluAndMul
from engine.models.rotary import RotaryEmbedding, apply_rotary
from pagedserve_kernels.cpu_kernels import cpu_kernels, toolchain_available

pytestmark = pytest.mark.skipif(not toolchain_available(), reason="no C++ toolchain")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.fixture(scope="module")
def ops():
    module = cpu_kernels()
    assert module is not None, "the C++ kernels did not build"
    return module


def tolerance(dtype: torch.dtype) -> dict:
    """float32: summation order differs from torch's; bf16/fp16: one rounding step."""
    return {torch.float32: dict(rtol=1e-5, atol=1e-6),
            torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
            torch.float16: dict(rtol=1e-3, atol=1e-3)}[dtype]


def strided_rows(rows: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, n] whose rows are not adjacent (a column slice of a wider tensor)."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, n + 24, generator=generator).to(dtype)
    return wide[:, 8:8 + n]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n", [(1, 576), (37, 64), (300, 200)])
def test_rms_norm_matches_torch(ops, dtype, rows, n):
    norm = RMSNorm(n, eps=1e-5)
    norm.weight.data = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = strided_rows(rows, n, dtype, seed=2)
    expected = norm.forward_torch(x)
    out = torch.empty(rows, n, dtype=dtype)
    ops.rms_norm(out, x, norm.weight, norm.eps)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    # The module takes the kernel and gives the same.
    torch.testing.assert_close(norm(x), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n", [(1, 576), (33, 96)])
def test_add_rms_norm_matches_torch(ops, dtype, rows, n):
    norm = RMSNorm(n, eps=1e-6)
    norm.weight.data = torch.rand(n, generator=torch.Generator().manual_seed(3)).to(dtype)
    x, residual = strided_rows(rows, n, dtype, seed=4), strided_rows(rows, n, dtype, seed=5)
    expected_out, expected_residual = norm.forward_torch(x, residual)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = norm(x_in, residual_in)
    assert out.data_ptr() == x_in.data_ptr() and new_residual.data_ptr() == residual_in.data_ptr()
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads,kv_heads,head_size,partial", [
    (9, 3, 64, 1.0), (4, 4, 128, 1.0), (4, 2, 64, 0.5),
], ids=["gqa-64", "mha-128", "partial-rotary"])
def test_rotary_matches_torch(ops, dtype, heads, kv_heads, head_size, partial):
    tokens = 11
    rope = RotaryEmbedding(head_size, 4096, {"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": partial})
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 101, 900, 3, 4000, 7])
    cos, sin = rope(positions)
    # q and k as views into one fused qkv output, as the model has them.
    generator = torch.Generator().manual_seed(6)
    width = (heads + 2 * kv_heads) * head_size
    qkv = torch.randn(tokens, width, generator=generator).to(dtype)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size: (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v_before = qkv[:, (heads + kv_heads) * head_size:].clone()
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ops.rotary_neox_(q, k, cos, sin)
    torch.testing.assert_close(q, expected_q, **tolerance(dtype))
    torch.testing.assert_close(k, expected_k, **tolerance(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inner", [(1, 1536), (19, 20), (64, 256)])
def test_silu_and_mul_matches_torch(ops, dtype, rows, inner):
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(rows, 2 * inner, generator=generator) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # the ends of exp's range
    expected = SiluAndMul.forward_torch(x)
    out = torch.empty(rows, inner, dtype=dtype)
    ops.silu_and_mul(out, x)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    torch.testing.assert_close(SiluAndMul()(x), expected, **tolerance(dtype))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_matches_torch(ops, cache_dtype, block_size):
    num_kv_heads, head_size, num_blocks, tokens = 3, 64, 9, 13
    generator = torch.Generator().manual_seed(8)
    kv = torch.randn(tokens, 2 * num_kv_heads * head_size, generator=generator)
    key = kv[:, : num_kv_heads * head_size].view(tokens, num_kv_heads, head_size)
    value = kv[:, num_kv_heads * head_size:].view(tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    slots[[2, 7]] = -1  # padding: skipped
    expected = torch.zeros(2, num_kv_heads, num_blocks, block_size, head_size, dtype=cache_dtype)
    write_to_kv_cache_torch(key, value, expected, slots, all_slots_valid=False)
    actual = torch.zeros_like(expected)
    ops.write_kv_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)


def test_write_kv_cache_rejects_a_slot_outside_the_cache(ops):
    cache = torch.zeros(2, 1, 2, 4, 16)
    key = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.write_kv_cache(key, key, cache, torch.tensor([8]))
    assert not cache.any()
