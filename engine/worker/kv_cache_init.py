"""Sizing and allocating the KV cache at start-up (vLLM's `_initialize_kv_caches`).

    1. collect each attention layer's spec (KV heads, head size, dtype, block size)
       and group the layers by attention kind (engine.kv_cache.groups)
    2. measure the memory left for KV after the weights and a profiling forward pass
    3. num_blocks = available_bytes // bytes of one block id (across all layers; with
       several groups across one group's layer slots; plus the draft model's layers
       with speculative draft_model), less the padding block
    4. allocate each tensor once, in the attention backend's layout
       (e.g. [2, num_blocks + 1, block_size, kv_heads, head_size]): one per layer, or
       with several groups one per layer slot, shared by the groups' layers

Block ids 0 .. num_blocks - 1 belong to the block pool; block id `num_blocks`, the
padding block, is never handed out: the padded rows of a CUDA-graph decode step
write their K/V there (engine/worker/cuda_graphs.py).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine import cpu_info
from engine.attention import kv_fp8
from engine.attention.kv_int8 import row_elements
from engine.attention.layer import Attention
from engine.config import KV_CACHE_DTYPES, CacheConfig
from engine.kv_cache.groups import KVCacheGroupSpec, group_size_of, layer_slots

# CPU default when --kv-cache-memory is not given: this share of available RAM, capped.
CPU_DEFAULT_KV_SHARE = 0.25
CPU_DEFAULT_KV_CAP_BYTES = 4 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int

    @property
    def row_elements(self) -> int:
        """Elements of one (token, head) row of K or V: head_size, plus an int8 row's scale."""
        return row_elements(self.head_size, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes in one layer (K and V)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.row_elements * itemsize


def get_kv_cache_specs(
    layers: list[Attention], dtype: torch.dtype, block_size: int
) -> list[KVCacheSpec]:
    return [KVCacheSpec(layer.num_kv_heads, layer.head_size, dtype, block_size) for layer in layers]


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """The KV cache's element type: `auto` is the model's dtype. A different one is a CPU
    feature (the attention there widens the cache to the query's dtype as it reads it;
    int8: rows with a scale each, engine/attention/kv_int8.py), but for fp8 (rows of
    float8_e4m3fn with a scale each, engine/attention/kv_fp8.py), which the Triton kernels
    read; the executor checks that the backend reads the chosen rows."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    if name == "fp8":
        return kv_fp8.DTYPE
    dtype = model_dtype if name == "auto" else getattr(torch, name)
    if dtype != model_dtype and device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype {name} differs from the model's "
                         f"{str(model_dtype).removeprefix('torch.')}: supported on CPU only")
    return dtype


# CUDA memory taken after the KV cache is sized, kept out of its share: the decode CUDA
# graphs' pool (the activations of the largest captured batch), the capture stream's
# cuBLAS workspace, Triton kernels compiled later, the allocator's rounding. An estimate
# for models up to ~10B; not yet measured on a GPU.
CUDA_HEADROOM_BYTES = 512 << 20


def available_kv_cache_bytes(device: torch.device, cache_config: CacheConfig) -> int:
    """Bytes the KV cache may take, measured after weights and the profiling pass.

    CUDA: device memory x --gpu-memory-utilization, less the profiling pass's peak
    (weights + activations), less what others (the CUDA context) hold, less the headroom.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        peak_torch = torch.cuda.max_memory_allocated(device)
        non_torch = (total - free) - torch.cuda.memory_reserved(device)
        budget = int(total * cache_config.gpu_memory_utilization)
        return budget - peak_torch - non_torch - CUDA_HEADROOM_BYTES
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    return min(int(cpu_info.available_memory_bytes() * CPU_DEFAULT_KV_SHARE), CPU_DEFAULT_KV_CAP_BYTES)


# Blocks allocated past the pool's: the padding block.
NUM_PADDING_BLOCKS = 1


def block_id_bytes(specs: list[KVCacheSpec], groups: list[KVCacheGroupSpec],
                   draft_specs: Sequence[KVCacheSpec] = ()) -> int:
    """Bytes one block id costs: a block in every layer, or with several groups a block
    in each of the `group_size` shared tensors (their layers must then agree in shape);
    plus a block in each draft-model layer (`draft_specs`: its own shapes)."""
    draft_bytes = sum(spec.block_bytes for spec in draft_specs)
    if len(groups) == 1:
        return sum(spec.block_bytes for spec in specs) + draft_bytes
    if len(set(specs)) != 1:
        raise ValueError("sliding-window and full-attention layers with different KV shapes "
                         f"are not supported: {sorted(set(specs), key=str)}")
    return group_size_of(groups) * specs[0].block_bytes + draft_bytes


def num_blocks_for(specs: list[KVCacheSpec], available_bytes: int,
                   groups: list[KVCacheGroupSpec] | None = None,
                   draft_specs: Sequence[KVCacheSpec] = ()) -> int:
    """Blocks the pool may hand out, once the padding block is set aside."""
    total = available_bytes // block_id_bytes(
        specs, groups or [KVCacheGroupSpec(None, ())], draft_specs)
    return max(0, total - NUM_PADDING_BLOCKS)


def allocate_kv_caches(
    specs: list[KVCacheSpec], num_blocks: int, device: torch.device,
    shape_of: Callable[[int, int, int, int], tuple[int, ...]],
    groups: list[KVCacheGroupSpec] | None = None,
) -> list[torch.Tensor]:
    """Each layer's cache tensor, zeroed (masked-out slots must never hold NaN), of
    `num_blocks` pool blocks plus the padding block, whose id is `num_blocks`.

    One tensor per layer; with several groups one per layer slot, and layer i gets
    the tensor of its slot (the same tensor object for the layers that share it).
    `shape_of(num_blocks, block_size, num_kv_heads, head_size)` is the attention
    backend's `kv_cache_shape`: the layout is the backend's choice. On the CPU the
    zeros are untouched pages (`zero_pages`): memory is committed as blocks are used.
    """
    def allocate(spec: KVCacheSpec) -> torch.Tensor:
        shape = shape_of(num_blocks + NUM_PADDING_BLOCKS, spec.block_size,
                         spec.num_kv_heads, spec.row_elements)
        if device.type == "cpu":
            return zero_pages(shape, spec.dtype)
        return torch.zeros(shape, dtype=spec.dtype, device=device)

    if groups is None or len(groups) == 1:
        return [allocate(spec) for spec in specs]
    shared = [allocate(specs[0]) for _ in range(group_size_of(groups))]
    return [shared[slot] for _, slot in layer_slots(groups, len(specs))]


def zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros backed by an anonymous memory mapping.

    The kernel hands out such pages zero-filled on first touch, so nothing is written
    now: a 2 GiB cache costs RSS only for the blocks requests have written (the block
    pool's free queue starts in block order, so the pages of blocks no request has
    used yet stay uncommitted until the prefix cache has cycled through them).
    `torch.zeros` would write every page.
    """
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, max(1, numel * dtype.itemsize))
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
