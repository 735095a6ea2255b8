"""ModelExecutor: loads the model, sizes the KV cache, runs steps (one device)."""

from __future__ import annotations

import logging

import torch

from engine.attention.selector import select_attention_backend
from engine.config import EngineConfig
from engine.core import KVCacheInfo
from engine.kv_cache.manager import cdiv
from engine.outputs import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.worker import kv_cache_init
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_PROFILE_TOKENS = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(name)


def resolve_max_model_len(hf_config, requested: int | None) -> int:
    """The model's own context length, or a smaller `requested` one."""
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is None:
        return model_len
    if requested > model_len:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's context length {model_len}"
        )
    return requested


class ModelExecutor:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner: ModelRunner | None = None

    def initialize(self) -> KVCacheInfo:
        from transformers import AutoConfig

        from engine.model_loader import load_model, resolve_dtype, resolve_model

        config = self.config
        device = resolve_device(config.device_config.device)
        torch.manual_seed(config.model_config.seed)
        model_dir = resolve_model(config.model_config.model).path
        hf_config = AutoConfig.from_pretrained(model_dir)
        dtype = resolve_dtype(hf_config, config.model_config.dtype, device)
        if device.type == "cpu":
            from engine import cpu_info
            from engine.model_loader.weights import auto_cpu_dtype

            why = (auto_cpu_dtype()[1] if config.model_config.dtype == "auto"
                   else f"--dtype {config.model_config.dtype}")
            logger.info("CPU: %s; compute dtype %s (%s)", cpu_info.describe(),
                        str(dtype).removeprefix("torch."), why)
        if device.type == "cpu":
            from kernels.cpu_kernels import cpu_kernels

            cpu_kernels()  # build (once per CPU) or load them now, not on the first request
        model = load_model(model_dir, dtype, device, config.model_config.quantization)
        max_model_len = resolve_max_model_len(hf_config, config.model_config.max_model_len)
        block_size = config.cache_config.block_size
        backend = select_attention_backend(config.device_config.attention_backend, device,
                                           block_size)
        sched = config.scheduler_config
        self.runner = ModelRunner(
            model, backend, device, max_num_reqs=sched.max_num_seqs, max_model_len=max_model_len,
            block_size=block_size, vocab_size=hf_config.vocab_size,
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # CUDA sizes the KV cache from the peak memory of a full-budget forward pass.
        # On CPU the KV budget is a byte count (--kv-cache-memory), so a short pass
        # that proves the model runs is enough and keeps start-up fast.
        num_profile_tokens = sched.max_num_batched_tokens
        if device.type != "cuda":
            num_profile_tokens = min(num_profile_tokens, CPU_PROFILE_TOKENS)
        self.runner.profile_run(num_profile_tokens)
        specs = kv_cache_init.get_kv_cache_specs(self.runner.attention_layers, dtype, block_size)
        if config.cache_config.num_gpu_blocks_override is not None:
            num_blocks = config.cache_config.num_gpu_blocks_override
        else:
            available = kv_cache_init.available_kv_cache_bytes(device, config.cache_config)
            num_blocks = kv_cache_init.num_blocks_for(specs, available)
            blocks_per_request = cdiv(max_model_len, block_size)
            if num_blocks < blocks_per_request:
                raise ValueError(
                    f"the KV cache fits {num_blocks * block_size} tokens, fewer than one "
                    f"request of max_model_len={max_model_len}: give it more memory "
                    "(--kv-cache-memory on CPU, --gpu-memory-utilization on GPU) or lower "
                    "--max-model-len"
                )
        self.runner.bind_kv_caches(kv_cache_init.allocate_kv_caches(
            specs, num_blocks, device, backend.kv_cache_shape))
        num_tokens = num_blocks * block_size
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB, %s, %s backend); "
            "maximum concurrency at max_model_len=%d: %.2fx",
            num_blocks, block_size, num_tokens,
            num_blocks * sum(s.block_bytes for s in specs) / 2**20, dtype, backend.name,
            max_model_len, num_tokens / max_model_len,
        )
        return KVCacheInfo(num_blocks, block_size, max_model_len, hf_config.vocab_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize() first"
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.runner = None
