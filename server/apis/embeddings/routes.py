"""The embedding routes: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and the
older POST /api/embeddings, over the shared path of server/apis/embeddings/run.py.

    curl localhost:8000/v1/embeddings -H 'Content-Type: application/json' \\
      -d '{"model": "all-MiniLM-L6-v2", "input": ["a cat", "two dogs"]}'
"""

from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import APIRouter, FastAPI

from server.apis.embeddings.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    OllamaEmbeddingsRequest,
    OllamaEmbeddingsResponse,
    OllamaEmbedRequest,
    OllamaEmbedResponse,
)
from server.apis.embeddings.run import (
    check_serves_embeddings,
    embed,
    pooling_params_for,
    tokenize_inputs,
)
from server.apis.ollama.protocol import OllamaError
from server.apis.ollama.routes import AnyContentTypeRoute
from server.apis.ollama.translator import served_name
from server.chat.sampling import check_model
from server.common.errors import ERROR_RESPONSES, bad_request, error_docs
from server.common.state import ServerState


def base64_vector(vector: list[float]) -> str:
    """OpenAI's base64 encoding: the float32 values, little-endian, as base64."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def install_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.post("/v1/embeddings", response_model=EmbeddingResponse, dependencies=auth,
              responses=ERROR_RESPONSES)
    async def embeddings(body: EmbeddingRequest) -> EmbeddingResponse:
        """One vector per input (the model's pooling: modules.json, or --runner pooling)."""
        check_model(state, body.model)
        check_serves_embeddings(state)
        params = pooling_params_for(state, body.dimensions)
        truncate = body.truncate_prompt_tokens
        if truncate is not None and truncate < -1 or truncate == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or at least 1.",
                              "truncate_prompt_tokens", "invalid_value")
        token_lists = tokenize_inputs(
            state, body.input, state.max_model_len if truncate == -1 else truncate)
        result = await embed(state, token_lists, params, "embd")
        encode = base64_vector if body.encoding_format == "base64" else (lambda v: v)
        return EmbeddingResponse(
            data=[EmbeddingData(index=i, embedding=encode(vector))
                  for i, vector in enumerate(result.vectors)],
            model=state.model_name,
            usage=EmbeddingUsage(prompt_tokens=result.num_prompt_tokens,
                                 total_tokens=result.num_prompt_tokens))

    router = APIRouter(route_class=AnyContentTypeRoute)
    errors = error_docs(OllamaError)

    @router.post("/api/embed", response_model=OllamaEmbedResponse, dependencies=auth,
                 responses=errors)
    async def api_embed(body: OllamaEmbedRequest) -> OllamaEmbedResponse:
        """Ollama's: one vector per input; `truncate` (default true) cuts inputs to fit."""
        start = time.perf_counter_ns()
        served_name(state, body.model)
        check_serves_embeddings(state)
        params = pooling_params_for(state, body.dimensions)
        token_lists = tokenize_inputs(state, body.input,
                                      state.max_model_len if body.truncate else None)
        result = await embed(state, token_lists, params, "ollama-embed")
        return OllamaEmbedResponse(model=body.model, embeddings=result.vectors,
                                   total_duration=time.perf_counter_ns() - start,
                                   prompt_eval_count=result.num_prompt_tokens)

    @router.post("/api/embeddings", response_model=OllamaEmbeddingsResponse,
                 dependencies=auth, responses=errors)
    async def api_embeddings(body: OllamaEmbeddingsRequest) -> OllamaEmbeddingsResponse:
        """Ollama's older endpoint: one prompt, one vector (cut to fit the context)."""
        served_name(state, body.model)
        check_serves_embeddings(state)
        token_lists = tokenize_inputs(state, body.prompt, state.max_model_len, "prompt")
        result = await embed(state, token_lists, state.pooling, "ollama-embeddings")
        return OllamaEmbeddingsResponse(embedding=result.vectors[0])

    app.include_router(router)
