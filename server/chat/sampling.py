"""From a request's sampling fields to the engine: the model check, the checks every
generation shares, SamplingParams, prompt checks, request ids and usage."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import Request

from engine.frontend.processor import check_prompt
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from server.common.errors import APIError, bad_request, from_exception
from server.common.protocol import (
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
)
from server.common.state import ServerState

LOGPROB_FLOOR = -9999.0  # -inf is not JSON


# The sampler works in float32: a top_p that rounds to 0 there keeps no token at all.
_MIN_TOP_P = 1e-30


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and NaN (degenerate logits) become the floor."""
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.served_model_names and (
            state.lora is None or model not in state.lora):
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def check_common(state: ServerState, body: SamplingFields, unsupported: tuple[str, str] | None):
    check_model(state, body.model)
    if state.runner == "pooling":
        raise bad_request(f"The model `{state.model_name}` is an embedding model: it serves "
                          "/v1/embeddings (and Ollama's /api/embed), not text generation.",
                          "model", "model_not_supported")
    if unsupported is not None:
        param, message = unsupported
        raise bad_request(message, param, "unsupported_parameter")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true.",
                          "stream_options", "invalid_value")
    if body.priority != 0 and state.scheduling_policy != "priority":
        raise bad_request("priority is only honoured when the server runs with "
                          "--scheduling-policy priority.", "priority", "unsupported_parameter")
    max_n = state.limits.max_n
    if body.n > max_n:
        raise bad_request(f"n must be at most {max_n} on this server (--max-n), got {body.n}.",
                          "n", "invalid_value")


def build_sampling_params(
    state: ServerState,
    body: SamplingFields,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    api_defaults: Mapping[str, Any] | None = None,
) -> SamplingParams:
    """The request's SamplingParams; a bad value is a 400 naming its field.

    A sampling field the request leaves unset takes the server's default
    (state.sampling_defaults: the owner's, then the model's generation config), else the
    API's own (`api_defaults`), else the neutral value (engine/sampling_defaults.py)."""
    max_logprobs = state.limits.max_logprobs
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value > max_logprobs:
            raise bad_request(f"{name} must be between 0 and {max_logprobs}, got {value}.",
                              name, "invalid_value")
    if body.top_p is not None and 0.0 < body.top_p < _MIN_TOP_P:
        raise bad_request(f"top_p must be at least {_MIN_TOP_P:g} (or use top_k=1), got "
                          f"{body.top_p}.", "top_p", "invalid_value")
    logit_bias = None
    if body.logit_bias:
        logit_bias = {}
        for key, bias in body.logit_bias.items():
            try:
                logit_bias[int(key)] = float(bias)
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}.",
                                  "logit_bias", "invalid_value") from None
    defaults = state.sampling_defaults

    def value(name: str, given, neutral):
        if given is not None:
            return given
        default = defaults.value(name, api_defaults)
        return neutral if default is None else default

    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    stop_token_ids = list(body.stop_token_ids or [])
    if not body.ignore_eos:  # the model's other end-of-sequence ids act like EOS
        for token_id in state.extra_stop_token_ids:
            if token_id not in stop_token_ids:
                stop_token_ids.append(token_id)
    try:
        return SamplingParams(
            n=body.n,
            temperature=value("temperature", body.temperature, 1.0),
            top_p=value("top_p", body.top_p, 1.0),
            top_k=value("top_k", body.top_k, 0),
            min_p=value("min_p", body.min_p, 0.0),
            seed=body.seed,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=value("repetition_penalty", body.repetition_penalty, 1.0),
            logit_bias=logit_bias,
            max_tokens=value("max_tokens", max_tokens, None),
            min_tokens=body.min_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=structured_outputs,
        )
    except Exception as exc:  # SamplingParamsError -> 400 naming the field
        if body.max_completion_tokens is not None and getattr(exc, "param", "") == "max_tokens":
            exc.param = "max_completion_tokens"
        raise from_exception(exc) from exc


def check_prompts(state: ServerState, prompts: Sequence[list[int]], params: SamplingParams,
                  body: SamplingFields, prompt_param: str = "prompt") -> None:
    """Validate every prompt before anything starts (a batch fails as a whole).

    Errors name the request's own fields (`prompt_param`; max_completion_tokens
    when the request used it).
    """
    engine = state.engine
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    if requested is None and params.max_tokens is not None and prompts:
        # A default cap (--max-tokens-default, the model's max_new_tokens), not the
        # request's own: it shrinks to the room the longest prompt leaves instead of
        # refusing the prompt. Example: context 2048, cap 512, a 1800-token prompt -> 248.
        room = engine.max_model_len - max(len(p) for p in prompts)
        params.max_tokens = min(params.max_tokens, room) if room >= 1 else None
    for prompt_token_ids in prompts:
        try:
            check_prompt(prompt_token_ids, params, engine.max_model_len, engine.vocab_size)
        except Exception as exc:
            error = from_exception(exc)
            if error.param == "prompt":
                error.param = prompt_param
            elif error.param == "max_tokens" and body.max_completion_tokens is not None:
                error.param = "max_completion_tokens"
            raise error from exc


def make_usage(outputs: Sequence[RequestOutput | None]) -> UsageInfo:
    prompt_tokens = sum(o.num_prompt_tokens for o in outputs if o is not None)
    completion_tokens = sum(o.num_generation_tokens for o in outputs if o is not None)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def record_usage(raw_request: Request, usage: UsageInfo) -> None:
    """Tell the access log how many tokens this request used."""
    raw_request.state.usage = usage


def record_user(raw_request: Request, body: SamplingFields) -> None:
    """Tell the access log the request's `user` (the only thing `user` is used for)."""
    if body.user:
        raw_request.state.user = body.user
