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


SPEC_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode/), spelled as vLLM's --speculative-config.

    Each step a decoding request may carry up to `num_speculative_tokens` proposed
    tokens that the model verifies in the same forward pass. `ngram` looks the request's
    last `prompt_lookup_max`..`prompt_lookup_min` tokens up earlier in its own tokens;
    `suffix` also looks in this server's recent outputs; `draft_model` runs `model`, a
    smaller checkpoint with the same tokenizer, greedily (engine/worker/draft_model.py).
    With `adaptive_draft_length` a request's drafts are at most `num_speculative_tokens`
    long and follow its acceptance: a fully accepted draft doubles the next one's length,
    a draft rejected at position a makes the next one a + 1 long.
    Back-off: no proposals while more than `disable_by_batch_size` requests run (a wide
    step is compute-bound: verifying costs more than it saves), and a request whose
    acceptance rate falls below `min_acceptance_rate` (after `backoff_min_draft_tokens`
    proposed tokens) stops proposing for `backoff_tokens` generated tokens, twice as long
    for each such window in a row (up to 16x).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    # draft_model: the draft checkpoint (a directory, a .gguf file or a hub id).
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 4
    adaptive_draft_length: bool = True
    min_acceptance_rate: float = 0.2
    backoff_min_draft_tokens: int = 16
    backoff_tokens: int = 64
    # suffix: how many recent outputs (and prompts) of finished requests it remembers.
    suffix_cache_max_requests: int = 64

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; "
                             f"choose one of {list(SPEC_METHODS)}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": the draft '
                             "checkpoint (a directory, a .gguf file or a hub id)")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError('"model" is the draft checkpoint of method "draft_model"; '
                             f"method {self.method!r} takes none")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be positive")

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """From vLLM's JSON keys; unknown keys are an error (a typo would go unnoticed)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        values = dict(values)
        # vLLM's default prompt_lookup_min is prompt_lookup_max when only that is given.
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(cls.prompt_lookup_min, values["prompt_lookup_max"])
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    # None: no speculative decoding (every step decodes one token per request).
    speculative_config: SpeculativeConfig | None = None


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
