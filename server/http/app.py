"""The FastAPI application: routes, API-key check, CORS, access log, OpenAPI schema.

Inference routes (/v1/*, /api/*, /tokenize, /detokenize) and the engine x-ray (/xray,
/xray/state; server/http/xray.py) need the API key when one is set (as a bearer token, or in
x-api-key); /health, /metrics, /version and /api/version stay open. Each API installs its
own routes (server/apis/{openai,responses,anthropic,ollama}/routes.py).

Middleware, outermost first: access log, CORS, shutdown gate (503 while draining),
request head/body size limits (431/413), catch-all (500 error object), then the routes.
"""

from __future__ import annotations

import hmac

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from server.apis.anthropic import routes as anthropic_routes
from server.apis.embeddings import routes as embedding_routes
from server.apis.ollama import routes as ollama_routes
from server.apis.openai import routes as openai_routes
from server.apis.responses import routes as responses_routes
from server.common.api_label import APILabelMiddleware
from server.common.errors import APIError, from_exception, install_error_handlers
from server.common.lifecycle import ShutdownGate, shutting_down_error
from server.common.protocol import (
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
    ErrorResponse,
    VersionResponse,
)
from server.common.state import ServerState
from server.common.version import package_version
from server.http.access_log import AccessLogMiddleware
from server.http.body_limit import RequestSizeLimit
from server.http.loads import install_load_routes
from server.http.xray import install_xray_routes


def build_app(state: ServerState, allowed_origins: list[str] | None = None) -> FastAPI:
    app = FastAPI(
        title="pagedserve",
        version=package_version(),
        description="OpenAI-compatible LLM inference server (paged KV cache, continuous batching).",
    )
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(RequestSizeLimit, max_body_bytes=state.limits.max_request_body_bytes,
                       max_header_bytes=state.limits.max_header_bytes, metrics=state.metrics)
    app.add_middleware(ShutdownGate, lifecycle=state.lifecycle)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins,
                           allow_credentials=True, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(APILabelMiddleware, metrics=state.metrics)
    app.add_middleware(AccessLogMiddleware)

    bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer <api key>`")
    x_api_key = APIKeyHeader(name="x-api-key", auto_error=False,
                             description="`x-api-key: <api key>` (Anthropic's header)")

    async def require_api_key(
        credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
        header_key: str | None = Depends(x_api_key),
    ) -> None:
        if state.api_key is None:
            return
        expected = state.api_key.encode()
        for given in (credentials.credentials if credentials else None, header_key):
            if given is not None and hmac.compare_digest(given.encode(), expected):
                return
        raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' "
                            "or 'x-api-key: <key>'.", code="invalid_api_key")

    auth = [Depends(require_api_key)]

    # ------------------------------------------------------------------ open routes
    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 while the engine core answers (a ping through its busy loop, or a step
        finished recently); 503 (with the reason) while draining or once it cannot serve."""
        if state.lifecycle.draining:
            return shutting_down_error().to_response()
        try:
            await state.engine.check_health(state.health_ping_timeout_s,
                                            state.health_step_timeout_s)
        except Exception as exc:  # noqa: BLE001 - dead, unresponsive: a 503 that says why
            error = from_exception(exc)
            if error.status_code != 503:
                error = APIError(503, error.message, code=error.code)
            return error.to_response()
        return Response(status_code=200)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=package_version())

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text"}})
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------- inference routes
    openai_routes.install_routes(app, state, auth)
    responses_routes.install_routes(app, state, auth)
    anthropic_routes.install_routes(app, state, auth)
    ollama_routes.install_routes(app, state, auth, package_version())
    embedding_routes.install_routes(app, state, auth)
    install_load_routes(app, state, auth)
    if state.lora is not None and state.lora_runtime_updating:
        from server.apis.openai.lora_routes import install_lora_routes

        install_lora_routes(app, state, auth)
    install_xray_routes(app, state)
    _install_openapi(app)
    return app


def _document_caps(components: dict, state: ServerState) -> None:
    """Write this server's caps (--max-n, --max-logprobs, the context length, prompts
    per request, the vocabulary) into the request schemas, so clients and fuzzers see
    them. Documentation only: the handlers check them, with messages naming the field."""
    limits = state.limits
    caps = {
        "n": limits.max_n, "logprobs": limits.max_logprobs,
        "top_logprobs": limits.max_logprobs, "max_tokens": state.max_model_len,
        "max_completion_tokens": state.max_model_len,
    }
    caps["max_output_tokens"] = state.max_model_len  # Responses; Anthropic's max_tokens
    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest",
                 "MessagesRequest"):
        properties = components.get(name, {}).get("properties", {})
        for field, cap in caps.items():
            if field in properties:
                properties[field]["maximum"] = cap
    token_id = {"minimum": 0, "maximum": state.engine.vocab_size - 1}
    prompt = components.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for branch in prompt.get("anyOf", []):
        if branch.get("type") != "array":
            continue
        branch["minItems"] = 1
        items = branch.get("items", {})
        if items.get("type") == "integer":  # one prompt's token ids
            items.update(token_id)
            branch["maxItems"] = state.max_model_len
            continue
        branch["maxItems"] = limits.max_prompts_per_request  # a batch of prompts
        if items.get("type") == "array":
            items["minItems"] = 1
            items.get("items", {}).update(token_id)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        stop_ids = components.get(name, {}).get("properties", {}).get("stop_token_ids", {})
        for branch in stop_ids.get("anyOf", []):
            if branch.get("type") == "array":
                branch.get("items", {}).update(token_id)
    tokens = components.get("DetokenizeRequest", {}).get("properties", {}).get("tokens", {})
    tokens.get("items", {}).update(token_id)


def _install_openapi(app: FastAPI) -> None:
    """Add the SSE chunk models (not return types of any route) to the schema."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionStreamResponse, ChatCompletionStreamResponse):
                model_schema = model.model_json_schema(
                    ref_template="#/components/schemas/{model}")
                for name, definition in model_schema.pop("$defs", {}).items():
                    components.setdefault(name, definition)
                components[model.__name__] = model_schema
            # FastAPI documents 422 for validation errors; this server answers 400.
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None and "400" not in responses:
                        responses["400"] = {
                            "description": "Invalid request",
                            "content": {"application/json": {"schema": {
                                "$ref": "#/components/schemas/ErrorResponse"}}},
                        }
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            state = getattr(app.state, "server", None)
            if state is not None:
                _document_caps(components, state)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

