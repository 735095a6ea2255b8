"""Executors: load the model, size the KV cache, run steps.

`Worker` is one rank's part (model runner + KV cache). `ModelExecutor` runs one
Worker in the engine core's process; `engine.executor.multiproc_executor` runs one per
tensor-parallel rank in worker processes; `engine.executor.abstract.make_executor` picks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.selector import select_attention_backend
from engine.config import EngineConfig
from engine.kv_cache.groups import KVCacheGroupSpec, make_kv_cache_groups
from engine.kv_cache.manager import cdiv
from engine.outputs import KVCacheInfo, ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.worker import kv_cache_init
from engine.worker.cuda_graphs import DecodeGraphConfig
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CPU_PROFILE_TOKENS = 256


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but no CUDA device is available")
    return torch.device(name)


def resolve_max_model_len(hf_config, requested: int | None,
                          max_positions: int | None = None) -> int:
    """The model's own context length, or a smaller `requested` one. `max_positions`: the
    most tokens the model's position table holds where that is less than
    max_position_embeddings (XLM-RoBERTa's 514 rows hold 512 tokens)."""
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    if max_positions is not None:
        model_len = min(model_len, max_positions)
    if requested is None:
        return model_len
    if requested > model_len:
        raise ValueError(
            f"--max-model-len {requested} exceeds the model's context length {model_len}"
        )
    return requested


@dataclass(frozen=True)
class RankInfo:
    """Where a worker sits: tensor-parallel `rank` of `size`; `local_rank` among the
    `local_size` ranks of its node (its CUDA device; its share of the CPU's KV budget)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1


class Worker:
    """One rank's model runner and KV cache; the one-process executor holds one, the
    multiprocess executor one per worker process.

        load()                 -> KV blocks this rank's budget holds (after profiling)
        init_kv_cache(blocks)  allocate them (every rank the same count: the minimum)
        execute_model(output)  one step
    """

    def __init__(self, config: EngineConfig, rank: RankInfo = RankInfo()):
        self.config = config
        self.rank = rank
        self.runner: ModelRunner | None = None
        self.device: torch.device | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.kv_cache_groups: list[KVCacheGroupSpec] | None = None
        self.draft_specs: list[kv_cache_init.KVCacheSpec] = []  # speculative draft_model

    def load(self) -> int:
        from engine.model_loader import load_model, resolve_dtype, resolve_model
        from engine.model_loader.hf_config import load_hf_config

        config, rank = self.config, self.rank
        device = resolve_device(config.device_config.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        torch.manual_seed(config.model_config.seed)
        model_dir = resolve_model(config.model_config.model,
                                  mmproj=config.model_config.mmproj).path
        hf_overrides = config.model_config.hf_overrides
        hf_config = load_hf_config(model_dir, hf_overrides)
        dtype = resolve_dtype(hf_config, config.model_config.dtype, device)
        if device.type == "cpu" and rank.rank == 0:
            from engine import cpu_info
            from engine.model_loader.weights import auto_cpu_dtype

            why = (auto_cpu_dtype()[1] if config.model_config.dtype == "auto"
                   else f"--dtype {config.model_config.dtype}")
            logger.info("CPU: %s; compute dtype %s (%s)", cpu_info.describe(),
                        str(dtype).removeprefix("torch."), why)
        if device.type == "cpu":
            from pagedserve_kernels.cpu_kernels import (
                activation_precision,
                cpu_kernels,
                set_activation_precision,
            )

            cpu_kernels()  # build (once per CPU) or load them now, not on the first request
            if config.model_config.activation_precision != "auto":
                # before loading: each packed weight's few-row limit depends on it
                set_activation_precision(config.model_config.activation_precision)
            precision = activation_precision()  # None without kernels
            if rank.rank == 0 and precision is not None:
                logger.info("packed linears: %s activations (--activation-precision %s)",
                            precision, config.model_config.activation_precision)
        from engine import batch_invariant

        batch_invariant.set_enabled(config.model_config.batch_invariant)
        model = load_model(model_dir, dtype, device, config.model_config.quantization,
                           hf_overrides)
        text_config = hf_config.get_text_config()  # a multimodal checkpoint's language model
        self.max_model_len = resolve_max_model_len(text_config, config.model_config.max_model_len,
                                                   getattr(model, "max_positions", None))
        if config.model_config.max_model_len is None and getattr(model, "is_pooling_model", False):
            from engine.model_loader.pooling_config import read_pooling_config

            seq_len = read_pooling_config(model_dir, hf_overrides).max_seq_length
            if seq_len is not None:  # where sentence-transformers truncates
                self.max_model_len = min(self.max_model_len, seq_len)
        budget = config.scheduler_config.max_num_batched_tokens
        serves_pooling = (getattr(model, "is_pooling_model", False)
                          or config.model_config.runner == "pooling")
        if serves_pooling and self.max_model_len > budget:
            # A pooling input is computed in one step: a longer one could never run, so it
            # is refused like any input past the context (a 400 naming the limit).
            logger.info("max_model_len %d -> %d: a pooling input is computed in one step "
                        "(--max-num-batched-tokens)", self.max_model_len, budget)
            self.max_model_len = budget
        self.vocab_size = text_config.vocab_size
        block_size = config.cache_config.block_size
        self.backend = select_attention_backend(config.device_config.attention_backend, device,
                                                block_size)
        sched = config.scheduler_config
        kv_cache_dtype = kv_cache_init.resolve_kv_cache_dtype(config.cache_config.kv_cache_dtype,
                                                              dtype, device)
        if kv_cache_dtype == torch.int8 and self.backend.name != "torch":
            raise ValueError(f"--kv-cache-dtype int8 needs the torch attention backend (the "
                             f"CPU's), not {self.backend.name}")
        if kv_cache_dtype == torch.float8_e4m3fn and self.backend.name != "triton":
            raise ValueError(f"--kv-cache-dtype fp8 needs the triton attention backend (CUDA), "
                             f"not {self.backend.name}; on the CPU use int8")
        draft_model = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            from engine.worker.draft_model import load_draft_model

            draft_model = load_draft_model(
                spec, model_dir, self.vocab_size, dtype, device,
                config.model_config.quantization, block_size,
                config.device_config.attention_backend)
            self.draft_specs = kv_cache_init.get_kv_cache_specs(
                draft_model.attention_layers, kv_cache_dtype, block_size)
        lora_manager = None
        lora = config.lora_config
        if lora.enable_lora:
            from engine.lora.manager import LoRAModelManager

            lora_manager = LoRAModelManager(model, text_config, lora.num_cpu_loras,
                                            lora.max_lora_rank, dtype, device)
        self.runner = ModelRunner(
            model, self.backend, device, max_num_reqs=sched.max_num_seqs,
            max_model_len=self.max_model_len, block_size=block_size, vocab_size=self.vocab_size,
            # Tensor-parallel ranks run eagerly: NCCL collectives inside captured CUDA
            # graphs have not been tried on a multi-GPU machine here.
            decode_graphs=DecodeGraphConfig.for_device(
                device, config.model_config.enforce_eager or rank.size > 1,
                sched.max_num_seqs),
            draft_model=draft_model,
            lora_manager=lora_manager,
        )
        if rank.size > 1:
            from engine.distributed.sampling import FirstRankSampler

            self.runner.sampler = FirstRankSampler(self.runner.sampler)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # CUDA sizes the KV cache from the peak memory of a full-budget forward pass.
        # On CPU the KV budget is a byte count (--kv-cache-memory), so a short pass
        # that proves the model runs is enough and keeps start-up fast.
        num_profile_tokens = sched.max_num_batched_tokens
        if device.type != "cuda":
            num_profile_tokens = min(num_profile_tokens, CPU_PROFILE_TOKENS)
        self.runner.profile_run(num_profile_tokens)
        self.specs = kv_cache_init.get_kv_cache_specs(
            self.runner.attention_layers, kv_cache_dtype, block_size)
        self.dtype = dtype
        self.kv_cache_groups = make_kv_cache_groups(
            [layer.sliding_window for layer in self.runner.attention_layers])
        if draft_model is not None and self.kv_cache_groups[0].sliding_window is not None:
            raise ValueError("speculative method draft_model needs a target with full-"
                             "attention layers: its draft reads KV-cache group 0's blocks, "
                             "and this model's keep only a sliding window")
        if not self.specs:
            # No KV cache (an encoder such as BERT attends within the step): the blocks
            # are bookkeeping only, enough for every seat to hold a whole context.
            return sched.max_num_seqs * -(-self.max_model_len // block_size)
        available = kv_cache_init.available_kv_cache_bytes(device, config.cache_config)
        if device.type == "cpu":
            available //= rank.local_size  # the CPU budget is the node's, shared by its ranks
        return kv_cache_init.num_blocks_for(self.specs, available, self.kv_cache_groups,
                                            self.draft_specs)

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.runner is not None, "load() first"
        block_size = self.config.cache_config.block_size
        groups = self.kv_cache_groups
        self.runner.set_kv_cache_groups(groups)
        self.runner.bind_kv_caches(kv_cache_init.allocate_kv_caches(
            self.specs, num_blocks, self.device, self.backend.kv_cache_shape, groups))
        draft_model = self.runner.draft_model
        if draft_model is not None:  # its own tensors, indexed by the same block ids
            draft_model.bind_kv_caches(kv_cache_init.allocate_kv_caches(
                self.draft_specs, num_blocks, self.device, draft_model.backend.kv_cache_shape))
        if self.rank.rank == 0:
            num_tokens = num_blocks * block_size
            logger.info(
                "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB%s, %s, %s backend); "
                "maximum concurrency at max_model_len=%d: %.2fx",
                num_blocks, block_size, num_tokens,
                num_blocks * kv_cache_init.block_id_bytes(self.specs, groups, self.draft_specs)
                / 2**20,
                f" on each of {self.rank.size} ranks" if self.rank.size > 1 else "",
                self.specs[0].dtype if self.specs else self.dtype, self.backend.name,
                self.max_model_len,
                num_tokens / self.max_model_len,
            )
            if len(groups) > 1:
                logger.info("KV cache groups (%d layer slots per block): %s",
                            max(len(g.layer_indices) for g in groups),
                            "; ".join(f"{i}: {g.kind} layers {list(g.layer_indices)}"
                                      for i, g in enumerate(groups)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "load() first"
        return self.runner.execute_model(scheduler_output)


def choose_num_blocks(config: EngineConfig, fits: list[int], max_model_len: int) -> int:
    """The KV block count every rank allocates: the override, else the smallest that
    fits (ranks may differ: another process on one GPU); ValueError if one request
    of max_model_len would not fit."""
    if config.cache_config.num_gpu_blocks_override is not None:
        return config.cache_config.num_gpu_blocks_override
    num_blocks = min(fits)
    block_size = config.cache_config.block_size
    if num_blocks < cdiv(max_model_len, block_size):
        raise ValueError(
            f"the KV cache fits {num_blocks * block_size} tokens, fewer than one "
            f"request of max_model_len={max_model_len}: give it more memory "
            "(--kv-cache-memory on CPU, --gpu-memory-utilization on GPU) or lower "
            "--max-model-len"
        )
    return num_blocks


class ModelExecutor:
    """The one-process executor: a Worker in the engine core's own process."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.worker: Worker | None = Worker(config)

    @property
    def runner(self) -> ModelRunner | None:
        return None if self.worker is None else self.worker.runner

    def initialize(self) -> KVCacheInfo:
        worker = self.worker
        fits = worker.load()
        num_blocks = choose_num_blocks(self.config, [fits], worker.max_model_len)
        worker.init_kv_cache(num_blocks)
        return KVCacheInfo(num_blocks, self.config.cache_config.block_size,
                           worker.max_model_len, worker.vocab_size, worker.kv_cache_groups)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.worker is not None, "initialize() first"
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker = None
