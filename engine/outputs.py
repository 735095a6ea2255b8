"""Typed handoffs out of the executor and the model runner, and out of the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from engine.kv_cache.groups import KVCacheGroupSpec


@dataclass(frozen=True)
class KVCacheInfo:
    """What start-up found out about the model and its KV cache (`Executor.initialize`)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    # The model's KV-cache groups (engine.kv_cache.groups); None: one group of all layers.
    kv_cache_groups: list[KVCacheGroupSpec] | None = None


@dataclass
class Logprobs:
    """Logprobs of the sampled token and the top-N alternatives, one row per token.

    Row i: `token_ids[i][0]` is the sampled token, followed by the top-N ids;
    `logprobs[i]` aligns with it; `ranks[i]` is the sampled token's rank (1 = best).
    """

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """One step's sampled tokens, in the order of `req_ids`.

    `sampled_token_ids[i]` is empty when request i is in the middle of a chunked
    prefill (no token is sampled until its whole prompt is computed).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # Requests whose step failed (e.g. a fault in the forward pass): req_id -> message.
    errors: dict[str, str] = field(default_factory=dict)
    # Pooling requests whose prompt this step computed: req_id -> their vector
    # (engine.worker.pooler); they sample nothing.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Seconds the vision encoder ran this step (0: no image was encoded).
    encoder_seconds: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request from one step.

    A msgspec struct sent as a msgpack array (no field names on the wire): a step
    carries one per request that got tokens, so building, encoding and decoding it
    is per-token work of the engine.
    """

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    pooled: list[float] | None = None  # a pooling request's vector (it finishes with it)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_token(self) -> bool:
        """Ended by EOS (stop_reason None) or a stop token id: its last token is that token."""
        return self.finish_reason == "stop" and not isinstance(self.stop_reason, str)


@dataclass
class SchedulerStats:
    """Per-step engine stats, the single source for the Prometheus metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0  # this step
    num_scheduled_tokens: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed this step (prefix-cache hits excluded)
    num_generation_tokens: int = 0  # tokens sampled this step
    # Whole prompts (prefix-cache hits included) of the requests whose first token was
    # sampled this step: each request's prompt counts once, never again after a preemption.
    num_prompt_tokens_prefilled: int = 0
    # One entry per request that got a token this step and had one before: seconds since
    # its previous token (a preemption's stall included).
    inter_token_latencies_s: list[float] = field(default_factory=list)
    step_duration_s: float = 0.0
    # Structured outputs: seconds of each grammar compile that finished since the last stats.
    grammar_compile_seconds: list[float] = field(default_factory=list)
    # Speculative decoding, since the last stats (vLLM's spec_decode_* counters): requests
    # that verified a draft, draft tokens, accepted ones, and accepted ones by position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Proposed draft tokens cut before verification because the request's grammar refused
    # them (structured outputs with speculation).
    spec_num_grammar_cut_tokens: int = 0
    # --enable-lora: adapter name -> its requests running / waiting now (vLLM's
    # running_lora_adapters / waiting_lora_adapters; the base's requests are not counted).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # Images (engine/sched/encoder_cache.py): encoded this step, read from the encoder
    # cache by a request that did not encode them, and the encoder's seconds.
    mm_images_encoded: int = 0
    mm_encoder_cache_hits: int = 0
    mm_encoder_seconds: float = 0.0
    # --cpu-turns (engine/core/cpu_turns.py): seconds this engine waited for its turn on
    # the CPUs since the last stats.
    cpu_turns_wait_seconds: float = 0.0


@dataclass
class EngineCoreOutputs:
    """Everything one engine-core step sends back to the frontend."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # First-scheduled times of requests that started this step: req_id -> time.time().
    scheduled_times: dict[str, float] = field(default_factory=dict)
