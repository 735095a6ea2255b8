"""The offline API: `LLM(model).generate(prompts, params)` over an in-process EngineCore.

The same front-end pipeline as the server's AsyncEngine: a Processor checks each prompt
and fans it out into n core requests; the OutputProcessor detokenizes, applies stop
strings and collects logprobs; the results are the server's `RequestOutput`s, finished.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from engine import openmp
from engine.config import EngineConfig, engine_options
from engine.core.core import EngineCore
from engine.core.cpu_turns import join_cpu_turns, turn_of
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.processor import Processor
from engine.lora.checkpoint import check_adapter
from engine.lora_request import LoRARequest
from engine.model_loader.resources import load_model_resources
from engine.multimodal.inputs import image_content_hash
from engine.multimodal.processor import ImagePromptProcessor
from engine.pooling_params import PoolingParams
from engine.request_output import RequestOutput
from engine.sampling_defaults import resolve_sampling_defaults
from engine.sampling_params import SamplingParams

# A prompt: text, token ids, vLLM's {"prompt": text} / {"prompt_token_ids": ids}, or (a
# vision model) {"prompt": text with one image placeholder per image, "multi_modal_data":
# {"image": a PIL image or a list of them}}.
PromptType = str | list[int] | dict[str, Any]


class LLM:
    """Generate offline, in this process.

    Example:
        llm = LLM(dtype="float32")                   # the default SmolLM2 model
        out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        print(out[0].outputs[0].text)

    The keywords are the engine's options (engine.config.engine_options()): the names of
    `pagedserve serve`'s engine flags with underscores, with the same defaults
    (`LLM(max_num_seqs=64)` is `--max-num-seqs 64`). A string goes through the flag's
    parser (`kv_cache_memory="2G"`); `speculative_config` also takes a dict of vLLM's keys.
    """

    def __init__(self, model: str | None = None, **options: Any):
        if "policy" in options:  # the keyword's name before it was the flag's
            options["scheduling_policy"] = options.pop("policy")
        try:
            _SIGNATURE.bind(self, model, **options)
        except TypeError as exc:  # an unknown keyword, as Python would say it
            raise TypeError(f"LLM() {exc}") from None
        from engine.model_loader import resolve_model

        openmp.warn_if_too_late()
        resolved = resolve_model(model, mmproj=options.get("mmproj"))
        self.model_dir = resolved.path
        config = EngineConfig.from_options(str(resolved.path), **options)
        # The tokenizer and EOS ids, as the server loads them: both stop at the same token.
        self.resources = load_model_resources(resolved.path, config.model_config.chat_template,
                                              config.model_config.hf_overrides)
        self.tokenizer = self.resources.tokenizer
        self.config = config
        self._checked_adapters: set[str] = set()  # adapter paths check_adapter passed
        self.engine_core = EngineCore(config)
        # --cpu-turns: each step in this group's turn, as a server's (engine/core/cpu_turns.py).
        self._cpu_turns = join_cpu_turns(config)
        self.max_model_len = self.engine_core.kv_cache_info.max_model_len
        self.processor = Processor(self.tokenizer, self.max_model_len,
                                   self.engine_core.kv_cache_info.vocab_size,
                                   self.resources.eos_token_id)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        self._images: ImagePromptProcessor | None = None  # a vision model's, on first use
        model_config = config.model_config
        self.sampling_defaults = resolve_sampling_defaults(
            model_config.generation_config, self.resources.generation_config,
            model_config.override_generation_config, model_config.max_tokens_default)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams of the sampling defaults in force (generation_config,
        override_generation_config, max_tokens_default: as the server's, see
        engine/sampling_defaults.py): what generate() and chat() use when given none."""
        return SamplingParams(**self.sampling_defaults.fields)

    def shutdown(self) -> None:
        """Stop the engine (with tensor_parallel_size > 1: its worker processes); idempotent."""
        self.engine_core.shutdown()
        if self._cpu_turns is not None:
            self._cpu_turns.close()
            self._cpu_turns = None

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); input order.
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base);
        needs `enable_lora=True`."""
        prompts = _prompt_list(prompts)
        lora_requests = self._lora_requests(lora_request, len(prompts))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        # The model's other EOS ids (generation_config) stop a request, as in the server.
        params_list = [self.resources.with_model_stops(params) for params in params_list]
        return self._run(prompts, params_list, use_tqdm, lora_requests=lora_requests)

    def _hf_text_config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.model_dir).get_text_config()

    def _lora_requests(self, lora_request, num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each checked against the base once."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            requests = [lora_request] * num_prompts
        else:
            requests = list(lora_request)
            if len(requests) != num_prompts:
                raise ValueError("give one LoRARequest, or one per prompt")
        lora = self.config.lora_config
        for request in {r for r in requests if r is not None}:
            if not lora.enable_lora:
                raise ValueError("a LoRARequest needs LLM(..., enable_lora=True)")
            if request.path not in self._checked_adapters:
                check_adapter(request.path, self._hf_text_config(), lora.max_lora_rank)
                self._checked_adapters.add(request.path)
        return requests

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

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One vector per prompt (`output.pooled`), in input order: each prompt computed
        whole in one step and pooled (engine.pooling_params; default: the model's own
        pooling, `self.resources.pooling`)."""
        from engine.frontend.async_engine import POOLING_SAMPLING_PARAMS

        prompts = _prompt_list(prompts)
        pooling_params = pooling_params or self.resources.pooling
        return self._run(prompts, [POOLING_SAMPLING_PARAMS] * len(prompts), use_tqdm,
                         pooling_params)

    def apply_chat_template(self, conversation: list[dict[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some versions
            ids = ids["input_ids"]
        return list(ids)

    # ---------------------------------------------------------------- internals
    def _process(self, prompt: PromptType, params: SamplingParams,
                 pooling_params: PoolingParams | None, lora: LoRARequest | None):
        """One prompt checked and fanned out (a dict prompt's images expanded first)."""
        mm_features = None
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            images = (prompt.get("multi_modal_data") or {}).get("image") or []
            images = images if isinstance(images, (list, tuple)) else [images]
            processed = self._image_processor().process(
                prompt["prompt"], [_Image(image, image_content_hash(image)) for image in images])
            prompt, mm_features = processed.token_ids, processed.features or None
        elif isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            if "prompt_token_ids" in prompt:
                prompt = [int(token) for token in prompt["prompt_token_ids"]]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids' "
                                 f"(got keys {sorted(prompt)})")
        return self.processor.process_inputs(
            str(next(self._counter)), prompt, params, time.time(),
            pooling_params=pooling_params, lora_request=lora, mm_features=mm_features)

    def _image_processor(self) -> ImagePromptProcessor:
        if self._images is None:
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(self.model_dir)
            self._images = ImagePromptProcessor.from_pretrained(self.model_dir, hf_config)
            if self._images is None:
                raise ValueError(f"{self.model_dir} is not a vision-language model: it takes "
                                 "no images")
        return self._images

    def _run(
        self, prompts: list[PromptType], params_list: list[SamplingParams], use_tqdm: bool,
        pooling_params: PoolingParams | None = None,
        lora_requests: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Add every request (raises PromptError before any is added), then step the core
        until all are done."""
        core, output_processor = self.engine_core, self.output_processor
        lora_requests = lora_requests or [None] * len(prompts)
        processed = [
            self._process(prompt, params, pooling_params, lora)
            for prompt, params, lora in zip(prompts, params_list, lora_requests, strict=True)
        ]
        states = [output_processor.add_request(request) for request in processed]
        for request in processed:
            for core_request in request.core_requests:
                core.add_request(core_request)
        num_sequences = len(output_processor.sequences)
        progress = tqdm(total=num_sequences, desc="generate", disable=not use_tqdm)
        try:
            while core.has_unfinished_requests():
                with turn_of(self._cpu_turns):
                    step = core.step()
                now, to_abort = time.time(), []
                for out in step.outputs:
                    state = output_processor.process_output(out, now, to_abort)
                    if state is not None and state.error is not None:
                        raise RuntimeError(state.error)
                if to_abort:
                    core.abort_requests(to_abort)
                # A finished sequence leaves `sequences`.
                progress.update(num_sequences - len(output_processor.sequences) - progress.n)
        finally:
            progress.close()
            for state in states:
                output_processor.remove_request(state)
        results = []
        for state in states:
            state.metrics.finished_time = time.time()
            results.append(OutputProcessor.make_output(state))
        return results


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, token ids, a dict) or several -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


@dataclass
class _Image:
    image: Any
    content_hash: str


def _signature() -> inspect.Signature:
    """LLM(model=None, *, <every engine option>=<its default>), for help() and checks."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([
        inspect.Parameter("self", kind), inspect.Parameter("model", kind, default=None),
        *(inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=d.default)
          for d in engine_options())])


_SIGNATURE = _signature()
LLM.__init__.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
