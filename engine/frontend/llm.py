"""The offline API: `LLM(model).generate(prompts, params)` over an in-process EngineCore."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_size,
)
from engine.core.core import EngineCore
from engine.frontend.async_engine import derive_seed
from engine.frontend.detokenizer import IncrementalDetokenizer
from engine.outputs import Logprobs
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams

PromptType = str | list[int]


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None


@dataclass
class RequestOutput:
    """A finished request: its prompt and its `n` samples, in sample order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    finished: bool = True


@dataclass
class _SampleState:
    output: CompletionOutput
    params: SamplingParams
    detokenizer: IncrementalDetokenizer  # the server's: same text, same stop-string rules
    prompt_logprobs: Logprobs = field(default_factory=Logprobs)

    @property
    def done(self) -> bool:
        return self.output.finish_reason is not None


class LLM:
    """Generate offline, in this process.

    Example:
        llm = LLM(dtype="float32")                   # the default SmolLM2 model
        out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        print(out[0].outputs[0].text)
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 2048,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_cache_memory: str | int | None = None,
        kv_cache_dtype: str = "auto",
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        device: str = "auto",
        attention_backend: str = "auto",
        policy: str = "fcfs",
        async_scheduling: bool = False,
        seed: int = 0,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
    ):
        from transformers import AutoTokenizer

        from engine.model_loader import resolve_model

        resolved = resolve_model(model)
        self.model_dir = resolved.path
        self.tokenizer = AutoTokenizer.from_pretrained(resolved.path)
        config = EngineConfig(
            model_config=ModelConfig(model=resolved.path, dtype=dtype, quantization=quantization,
                                     max_model_len=max_model_len, seed=seed,
                                     enforce_eager=enforce_eager),
            cache_config=CacheConfig(
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_memory_bytes=parse_size(kv_cache_memory) if kv_cache_memory else None,
                kv_cache_dtype=kv_cache_dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                num_gpu_blocks_override=num_gpu_blocks_override,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill, policy=policy,
                async_scheduling=async_scheduling,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                           enable_expert_parallel=enable_expert_parallel),
            device_config=DeviceConfig(device=device, attention_backend=attention_backend),
        )
        self.engine_core = EngineCore(config)
        self.max_model_len = self.engine_core.kv_cache_info.max_model_len
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine (with tensor_parallel_size > 1: its worker processes); idempotent."""
        self.engine_core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- public API
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        return self._run(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template (with the generation prompt), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conversation) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)

    # ---------------------------------------------------------------- internals
    def _run(
        self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        core = self.engine_core
        results: list[RequestOutput] = []
        samples: dict[str, _SampleState] = {}
        owner: dict[str, RequestOutput] = {}
        eos_token_id = self.tokenizer.eos_token_id
        for prompt, params in zip(prompts, params_list, strict=True):
            prompt_ids = self._encode(prompt)
            request_id = str(next(self._counter))
            result = RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                                   prompt_ids, outputs=[])
            results.append(result)
            for index in range(params.n):
                sample_params = replace(params, n=1, seed=derive_seed(params.seed, index))
                sub_id = f"{request_id}-{index}"
                output = CompletionOutput(index=index, text="", token_ids=[])
                if params.logprobs is not None:
                    output.logprobs = Logprobs()
                result.outputs.append(output)
                samples[sub_id] = _SampleState(output, sample_params,
                                               IncrementalDetokenizer.from_params(
                                                   self.tokenizer, prompt_ids, sample_params))
                owner[sub_id] = result
                core.add_request(EngineCoreRequest(sub_id, prompt_ids, sample_params,
                                                   eos_token_id=eos_token_id))

        progress = tqdm(total=len(samples), desc="generate", disable=not use_tqdm)
        while core.has_unfinished_requests():
            step = core.step()
            for out in step.outputs:
                state = samples[out.req_id]
                state.output.token_ids.extend(out.new_token_ids)
                if out.new_logprobs is not None and state.output.logprobs is not None:
                    _extend_logprobs(state.output.logprobs, out.new_logprobs)
                if out.new_prompt_logprobs is not None:
                    _extend_logprobs(state.prompt_logprobs, out.new_prompt_logprobs)
                owner[out.req_id].num_cached_tokens = out.num_cached_tokens
                if out.error is not None:
                    raise RuntimeError(out.error)
                if state.done:
                    continue
                stop_string = state.detokenizer.update(
                    out.new_token_ids, stop_token_terminated=out.stopped_by_token)
                if stop_string is not None:
                    if not out.finished:
                        core.abort_requests([out.req_id])
                    state.output.finish_reason, state.output.stop_reason = "stop", stop_string
                elif out.finished:
                    state.output.finish_reason = out.finish_reason
                    state.output.stop_reason = out.stop_reason
                if state.done:
                    progress.update(1)
        progress.close()

        for sub_id, state in samples.items():
            state.output.text = state.detokenizer.get_text(finished=True)
            if state.params.prompt_logprobs is not None:
                owner[sub_id].prompt_logprobs = state.prompt_logprobs
        return results

    def _encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)


def _extend_logprobs(into: Logprobs, new: Logprobs) -> None:
    into.token_ids.extend(new.token_ids)
    into.logprobs.extend(new.logprobs)
    into.ranks.extend(new.ranks)
