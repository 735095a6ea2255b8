"""The embedding path every embedding endpoint shares: inputs -> token ids -> one pooling
request each (engine/pooling_params.py), admitted together, vectors back in input order.

    ["a cat", "two dogs"] --tokenize (special tokens: [CLS] ... [SEP])--> [[101, ...], ...]
      --Lifecycle.start (one engine request per input, pooling_params)--> vectors
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.frontend.async_engine import POOLING_SAMPLING_PARAMS
from engine.pooling_params import PoolingParams
from server.apis.embeddings.protocol import MAX_INPUTS_PER_REQUEST
from server.chat.sampling import new_request_id
from server.common.errors import APIError, bad_request, from_exception
from server.common.state import ServerState


@dataclass
class Embeddings:
    vectors: list[list[float]]
    num_prompt_tokens: int


def check_serves_embeddings(state: ServerState, scores: bool = False) -> None:
    """A 400 naming what the model serves, for a model that does not pool (and, unless
    `scores`, for a cross-encoder, which scores pairs and has no vectors)."""
    if state.cross_encoder and not scores:
        raise bad_request(f"The model `{state.model_name}` is a cross-encoder: it scores "
                          "pairs (/v1/rerank, /v1/score) and serves no embeddings.", "model",
                          "model_not_supported")
    if state.runner != "pooling":
        raise bad_request(f"The model `{state.model_name}` generates text; it does not serve "
                          "embeddings (start an embedding model, or a decoder with --runner "
                          "pooling).", "model", "model_not_supported")


def pooling_params_for(state: ServerState, dimensions: int | None) -> PoolingParams:
    """The model's pooling, cut to `dimensions` where the model allows it (Matryoshka)."""
    params = state.pooling
    if dimensions is None or dimensions == state.embedding_size:
        return params
    if not state.matryoshka:
        raise bad_request(f"The model `{state.model_name}` does not declare Matryoshka "
                          f"dimensions: `dimensions` may only be {state.embedding_size}.",
                          "dimensions", "invalid_value")
    if not 1 <= dimensions <= state.embedding_size:
        raise bad_request(f"dimensions must be 1..{state.embedding_size}, got {dimensions}.",
                          "dimensions", "invalid_value")
    return dataclasses.replace(params, dimensions=dimensions)


def check_num_inputs(num_inputs: int, param: str) -> None:
    """A 400 for more inputs (each one engine request) than one request may hold."""
    if num_inputs > MAX_INPUTS_PER_REQUEST:
        raise bad_request(f"{num_inputs} inputs in one request; at most "
                          f"{MAX_INPUTS_PER_REQUEST} are allowed.", param, "invalid_value")


def prompt_prefix(state: ServerState, prompt_name: str | None) -> str:
    """The text put before each text input: the named sentence-transformers prompt, or
    the model's default one ("" without); a 400 naming the model's prompts otherwise."""
    prompts = state.embedding_prompts
    name = prompt_name if prompt_name is not None else prompts.default_name
    if name is None:
        return ""
    if name not in prompts.prompts:
        known = ", ".join(sorted(prompts.prompts)) or "none"
        raise bad_request(f"The model `{state.model_name}` has no prompt named {name!r} "
                          f"(its prompts: {known}).", "prompt_name", "invalid_value")
    return prompts.prompts[name]


def prompted_inputs(state: ServerState, inputs: str | Sequence, truncate_to: int | None,
                    params: PoolingParams, prompt_name: str | None = None,
                    param: str = "input") -> tuple[list[list[int]], PoolingParams]:
    """tokenize_inputs with the model's prompt (prompt_prefix) before each text, and the
    pooling for them: where the model's Pooling leaves prompts out (include_prompt false),
    mean pooling skips the prompt's tokens less its closing special token, as
    sentence-transformers counts them."""
    prefix = prompt_prefix(state, prompt_name)
    token_lists = tokenize_inputs(state, inputs, truncate_to, param, prefix)
    texts = isinstance(inputs, str) or isinstance(inputs[0], str)  # not empty: checked
    if prefix and texts and not state.embedding_prompts.pooled and \
            params.pooling_type == "mean":
        params = dataclasses.replace(
            params, prompt_tokens=len(state.tokenizer(prefix).input_ids) - 1)
    return token_lists, params


def tokenize_inputs(state: ServerState, inputs: str | Sequence, truncate_to: int | None,
                    param: str = "input", prefix: str = "") -> list[list[int]]:
    """Token ids of each input (a text, texts, ids or id lists); a 400 for an empty list,
    an empty input, too many inputs, or one longer than the context unless `truncate_to`
    (tokens) cuts its end (a text keeps its closing special token, as sentence-transformers
    truncates). `prefix` (a prompt_prefix) goes before each text, not before token ids."""
    if isinstance(inputs, str):
        inputs = [inputs]
    elif inputs and isinstance(inputs[0], int):
        inputs = [inputs]
    if not inputs:
        raise bad_request("The input is an empty list.", param, "invalid_value")
    check_num_inputs(len(inputs), param)
    limit = state.max_model_len if truncate_to is None else min(truncate_to, state.max_model_len)
    vocab_size = state.engine.vocab_size
    token_lists = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise bad_request(f"Input {index} is an empty string.", param, "invalid_value")
            tokenizer_args = {"truncation": True, "max_length": limit} if truncate_to else {}
            ids = list(state.tokenizer(prefix + item, **tokenizer_args).input_ids)
        else:
            ids = [int(t) for t in item]
            if not ids:
                raise bad_request(f"Input {index} is an empty token list.", param,
                                  "invalid_value")
            if any(not 0 <= t < vocab_size for t in ids):
                raise bad_request(f"Input {index} has a token id out of the vocabulary "
                                  f"(0..{vocab_size - 1}).", param, "invalid_value")
            if truncate_to:
                ids = ids[:limit]
        if len(ids) > state.max_model_len:
            raise bad_request(f"Input {index} has {len(ids)} tokens; this model's maximum "
                              f"context length is {state.max_model_len} tokens.", param,
                              "context_length_exceeded")
        token_lists.append(ids)
    return token_lists


async def embed(state: ServerState, token_lists: list[list[int]],
                params: PoolingParams | list[PoolingParams], id_prefix: str) -> Embeddings:
    """The vectors of `token_lists`, in order: one engine request each, all admitted (or
    a 503) at once; an unfinished one is aborted if this is cancelled."""
    request_id = new_request_id(id_prefix)
    start = time.monotonic()
    active = await state.lifecycle.start(
        [(f"{request_id}-{i}", ids, None) for i, ids in enumerate(token_lists)],
        POOLING_SAMPLING_PARAMS, pooling_params=params)
    try:
        outputs = await asyncio.gather(*(stream.final_output() for stream in active.streams))
    except Exception as exc:
        raise from_exception(exc) from exc
    finally:
        await active.finish()
    if (error := active.error()) is not None:
        raise error
    if any(output is None or output.pooled is None for output in outputs):
        raise APIError(500, "The engine finished an embedding request without its vector.",
                       code="engine_error")
    num_tokens = sum(map(len, token_lists))
    state.metrics.record_embeddings(len(token_lists), num_tokens, time.monotonic() - start)
    return Embeddings([output.pooled for output in outputs], num_tokens)

