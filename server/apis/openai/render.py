"""vLLM's render endpoints: a request rendered to what the engine would run, not run.

    POST /v1/chat/completions/render   a chat request   -> one RenderedRequest
    POST /v1/completions/render        a completion     -> one RenderedRequest per prompt

Each answer holds the prompt's token ids (the chat template applied, images expanded into
their placeholder runs, as /v1/chat/completions would send them), the images' content
hashes and runs, and the sampling parameters under vLLM's names. vllm-router's
cache-aware policy tokenizes chats through it (falling back to /tokenize), llm-d's
token producer reads it. Bad requests get the same 400s as the generating endpoints;
nothing reaches the engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI, Request

from engine.multimodal.inputs import ImageFeature
from engine.sampling_params import SamplingParams
from server.apis.openai.completions import prepare_completion
from server.chat.run import prepare_chat
from server.chat.sampling import new_request_id
from server.common.errors import ERROR_RESPONSES
from server.common.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PlaceholderRange,
    RenderedFeatures,
    RenderedRequest,
)
from server.common.state import ServerState


def sampling_params_json(params: SamplingParams, num_prompt_tokens: int,
                         max_model_len: int) -> dict[str, Any]:
    """SamplingParams as vLLM's JSON spells them: max_tokens resolved against the context
    (None means the rest of it), a grammar as {kind: spec} (vLLM's structured_outputs)."""
    out = dataclasses.asdict(params)
    if params.max_tokens is None:
        out["max_tokens"] = max_model_len - num_prompt_tokens
    grammar = params.structured_outputs
    out["structured_outputs"] = None if grammar is None else {grammar.kind: grammar.spec}
    return out


def rendered_features(features: list[ImageFeature] | None) -> RenderedFeatures | None:
    if not features:
        return None
    return RenderedFeatures(
        mm_hashes={"image": [f.identifier for f in features]},
        mm_placeholders={"image": [PlaceholderRange(offset=f.offset, length=f.length)
                                   for f in features]})


def install_render_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.post("/v1/chat/completions/render", response_model=RenderedRequest,
              dependencies=auth, responses=ERROR_RESPONSES)
    async def render_chat(body: ChatCompletionRequest, raw_request: Request) -> RenderedRequest:
        """The chat request's prompt token ids and sampling parameters (vLLM's render)."""
        chat = await prepare_chat(state, body, raw_request)
        return RenderedRequest(
            request_id=new_request_id("chatcmpl"), token_ids=chat.prompt_token_ids,
            features=rendered_features(chat.mm_features),
            sampling_params=sampling_params_json(chat.params, len(chat.prompt_token_ids),
                                                 state.max_model_len),
            model=state.response_model(body.model), stream=body.stream,
            stream_options=body.stream_options, cache_salt=body.cache_salt,
            priority=body.priority)

    @app.post("/v1/completions/render", response_model=list[RenderedRequest],
              dependencies=auth, responses=ERROR_RESPONSES)
    async def render_completion(body: CompletionRequest,
                                raw_request: Request) -> list[RenderedRequest]:
        """One rendered request per prompt (vLLM's render of /v1/completions)."""
        prompts, params = await prepare_completion(state, body, raw_request)
        request_id = new_request_id("cmpl")
        return [RenderedRequest(
            request_id=f"{request_id}-{index}", token_ids=ids,
            sampling_params=sampling_params_json(params, len(ids), state.max_model_len),
            model=state.response_model(body.model), stream=body.stream,
            stream_options=body.stream_options, cache_salt=body.cache_salt,
            priority=body.priority) for index, (_, ids) in enumerate(prompts)]
