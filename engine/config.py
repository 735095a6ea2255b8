"""Engine configuration: frozen dataclasses built once at start-up.

Values discovered at start-up (like the number of KV blocks) are returned by the
code that finds them, never written back here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a local HF directory, a .gguf file, or a hub id
    served_model_name: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    quantization: str = "auto"  # auto | none | int8 | int4 (engine.model_loader.quantize)
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, no CUDA graphs
    batch_invariant: bool = False  # a row's result independent of its batch (engine.batch_invariant)


# --kv-cache-dtype's choices: "auto" = the model's compute dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: Literal["sha256", "xxhash"] = "sha256"
    kv_cache_memory_bytes: int | None = None  # CPU: bytes for KV; None = a share of free RAM
    gpu_memory_utilization: float = 0.9  # CUDA: fraction of device memory we may use
    num_gpu_blocks_override: int | None = None  # tests: force a small pool
    # KV cache element type: "auto" = the model's compute dtype; on CPU also "float16" or
    # "bfloat16" under a float32 model (half the bytes per token read by attention).
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"
    # Schedule step N+1 while step N runs (engine/core/core.py): the engine's own work
    # then hides behind the model's instead of adding to it.
    async_scheduling: bool = False
    max_model_len: int = 2048  # resolved from ModelConfig at start-up


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (engine.distributed). Several nodes use torchrun's meaning:
    `nnodes` hosts, this one `node_rank` (0 runs the server), all joining the process
    group at master_addr:master_port (None on one node: a free port)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # MoE experts: whole experts split over the ranks instead of every expert's columns.
    enable_expert_parallel: bool = False


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto | torch | flash_attn | triton
    cpu_threads: int | None = None  # CPU compute threads; None = the CPUs we may use
    # shared: the engine core computes on every CPU we may use; split: one CPU is kept
    # for the HTTP frontend and the core is pinned to the rest (vLLM's CPU layout).
    cpu_layout: str = "shared"


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse a byte count with an optional K/M/G/T suffix (binary units).

    Example: "512M" -> 536870912, "1.5G" -> 1610612736, "4096" -> 4096.
    """
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (use bytes with an optional K/M/G/T suffix)")
    number, unit, _ = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.upper()])
