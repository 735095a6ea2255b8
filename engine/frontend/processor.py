"""Checks on a tokenized prompt before it reaches the engine core.

Shared by the server's AsyncEngine and the offline LLM API: bad input is the
caller's error (a `PromptError`, which the server turns into a 400), never a crash.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.sampling_params import SamplingParams


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
