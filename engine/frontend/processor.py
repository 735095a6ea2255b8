"""Processor: a prompt and its SamplingParams in, engine-core requests out.

    prompt (text or ids) ──tokenize──▶ check_prompt ──▶ n fan-out ──▶ EngineCoreRequest x n
                                                        "{req_id}-{i}", seed derive_seed(seed, i)

Shared by the server's AsyncEngine and the offline LLM API: bad input is the
caller's error (a `PromptError`, which the server turns into a 400), never a crash.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.lora_request import LoRARequest
from engine.multimodal.inputs import ImageFeature
from engine.pooling_params import PoolingParams
from engine.request import EngineCoreRequest
from engine.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1


class PromptError(ValueError):
    """An invalid prompt; `param` names the request field, `code` is a short error code."""

    def __init__(self, message: str, param: str = "prompt", code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def check_prompt(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
) -> None:
    """Raise PromptError unless the prompt is non-empty, in the vocabulary, and fits.

    Fits: the prompt leaves room for at least one new token, and for `max_tokens` new
    tokens when that is set.
    """
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens == 0:
        raise PromptError("The prompt is empty: it must contain at least one token.")
    for token_id in prompt_token_ids:
        if not 0 <= token_id < vocab_size:
            raise PromptError(
                f"Token id {token_id} is out of vocabulary (valid ids are 0..{vocab_size - 1})."
            )
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < vocab_size:
            raise PromptError(
                f"stop_token_ids names token id {token_id}, which is out of vocabulary "
                f"(valid ids are 0..{vocab_size - 1}).",
                param="stop_token_ids",
            )
    if params.logit_bias:
        for token_id in params.logit_bias:
            if not 0 <= int(token_id) < vocab_size:
                raise PromptError(
                    f"logit_bias names token id {token_id}, which is out of vocabulary "
                    f"(valid ids are 0..{vocab_size - 1}).",
                    param="logit_bias",
                )
    max_tokens = params.max_tokens
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise PromptError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt has {num_prompt_tokens} tokens, which leaves no room for the "
                "completion. Please reduce the length of the prompt.",
                code="context_length_exceeded",
            )
    elif num_prompt_tokens + max_tokens > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the "
            "prompt or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of sequence `index` of a request: index 0 keeps the seed, the rest differ.

    Deterministic (splitmix64 of seed and index), so one seed gives the same n samples
    every time, and n different ones.
    """
    if seed is None or index == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * index) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


@dataclass
class ProcessedRequest:
    """A checked request: its prompt and the n engine-core requests it fans out to."""

    req_id: str
    prompt: str | None  # the text, when it came as text (or the caller gave it)
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    core_requests: list[EngineCoreRequest]  # sequence i is core_requests[i]


class Processor:
    """Turns a prompt and its SamplingParams into engine-core requests (see module doc).

    `tokenizer` is a Hugging Face tokenizer; text prompts get its special tokens.
    """

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int,
                 eos_token_id: int | None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size  # the embedding's (may be padded past the tokenizer)
        self.eos_token_id = eos_token_id

    def process_inputs(
        self,
        req_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float,
        *,
        prompt_text: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> ProcessedRequest:
        """Tokenize and check (raises PromptError), then fan out: a request with n == 1
        keeps its id; sequence i of a larger n is "{req_id}-{i}" with its own seed.
        A pooling request (`pooling_params`) may fill the whole context. `mm_features`:
        the prompt's images (token ids given, their placeholder runs expanded already:
        engine/multimodal/processor.py)."""
        if isinstance(prompt, str):
            prompt_text = prompt
            prompt_token_ids = list(self.tokenizer(prompt).input_ids)
        else:
            prompt_token_ids = [int(t) for t in prompt]
        check_prompt(prompt_token_ids, params,
                     self.max_model_len + (pooling_params is not None), self.vocab_size)
        core_requests = [
            EngineCoreRequest(
                req_id=req_id if params.n == 1 else f"{req_id}-{index}",
                prompt_token_ids=prompt_token_ids,
                sampling_params=dataclasses.replace(
                    params, n=1, seed=derive_seed(params.seed, index)),
                eos_token_id=self.eos_token_id,
                arrival_time=arrival_time,
                priority=priority,
                cache_salt=cache_salt,
                pooling_params=pooling_params,
                lora_request=lora_request,
                mm_features=mm_features,
            )
            for index in range(params.n)
        ]
        return ProcessedRequest(req_id, prompt_text, prompt_token_ids, params, arrival_time,
                                core_requests)
