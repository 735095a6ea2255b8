"""Triton kernel: scatter this step's new K/V tokens into the paged KV cache.

Contract::

    key, value   [T, Hkv, D]                                 the step's new tokens
    kv_cache     [2, num_blocks, block_size, Hkv, D]         0 = K, 1 = V; written in place
    slot_mapping int64 [T]    slot = block_id * block_size + offset;  -1 = padding, skipped

Worked example (block_size = 4)::

    slot_mapping = [9, 10, -1]
    token 0 -> slot 9  -> block 2, offset 1 -> kv_cache[:, 2, 1] = key[0], value[0]
    token 1 -> slot 10 -> block 2, offset 2 -> kv_cache[:, 2, 2] = key[1], value[1]
    token 2 -> slot -1 -> padding, nothing written

One program per token; it copies the token's whole ``[Hkv, D]`` tile for both K and V.
"""

from __future__ import annotations  # keeps the `tl.constexpr` annotations as strings

from typing import Any

import torch

from . import check_device, jit_kernel, next_pow2

tl: Any = None  # bound to triton.language by pagedserve_kernels.jit_kernel before the first launch


def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_cache_kv,  # K -> V
    stride_cache_block,
    stride_cache_offset,
    stride_cache_h,
    stride_cache_d,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS rounded up to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_SIZE rounded up to a power of two
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)

    token64 = token.to(tl.int64)
    k = tl.load(key_ptr + token64 * stride_key_t + h * stride_key_h + d * stride_key_d, mask=mask)
    v = tl.load(
        value_ptr + token64 * stride_value_t + h * stride_value_h + d * stride_value_d, mask=mask
    )

    dst = (
        kv_cache_ptr
        + block_id * stride_cache_block
        + offset * stride_cache_offset
        + h * stride_cache_h
        + d * stride_cache_d
    )
    tl.store(dst, k.to(kv_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_cache_kv, v.to(kv_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping``, in place.

    Tokens whose slot is ``-1`` are skipped. Values are cast to the cache dtype.
    Same semantics as ``pagedserve_kernels.reference.reshape_and_cache_ref``.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_size, kv_cache.shape
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    if num_tokens == 0:
        return
    check_device(kv_cache)
    kernel = jit_kernel(_reshape_and_cache_kernel)
    kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *kv_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_size),
    )
