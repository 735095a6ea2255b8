"""Which API a request speaks, by its path: the label of the per-API request counter
(`pagedserve:api_requests_total{api, status}`) and of the access log (`api=...`).

    /v1/chat/completions  openai_chat          /v1/messages   anthropic_messages
    /v1/completions       openai_completions   /api/chat      ollama_chat
    /v1/responses         openai_responses     /api/generate  ollama_generate

Only the generation routes have a label; other paths (models, tokenize, /api/tags, ...)
are not counted. A request id starts with its API's prefix (`REQUEST_ID_PREFIXES`), which
is how the x-ray labels each request it lists (`api_of_request_id`).
"""

from __future__ import annotations

from typing import Any

GENERATION_APIS = {
    "/v1/chat/completions": "openai_chat",
    "/v1/completions": "openai_completions",
    "/v1/responses": "openai_responses",
    "/v1/messages": "anthropic_messages",
    "/api/chat": "ollama_chat",
    "/api/generate": "ollama_generate",
    "/v1/embeddings": "openai_embeddings",
    "/api/embed": "ollama_embed",
    "/api/embeddings": "ollama_embeddings",
    "/score": "vllm_score",
    "/v1/score": "vllm_score",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
}
# Each API's request id prefix (server/serving_*.py: new_request_id(prefix)), longest first
# where one could begin another.
REQUEST_ID_PREFIXES = {
    "chatcmpl-": "openai_chat",
    "cmpl-": "openai_completions",
    "resp-": "openai_responses",
    "msg-": "anthropic_messages",
    "ollama-chat-": "ollama_chat",
    "ollama-generate-": "ollama_generate",
    "embd-": "openai_embeddings",
    "ollama-embeddings-": "ollama_embeddings",
    "ollama-embed-": "ollama_embed",
    "score-": "vllm_score",
    "rerank-": "rerank",
}
# The routes whose requests reach the engine (failures count as failed requests).
GENERATION_PATHS = frozenset(GENERATION_APIS)


def api_of_request_id(request_id: str) -> str | None:
    """"resp-3f2a..." -> "openai_responses"; None for an id no API route made (the
    offline LLM's, or a client's own)."""
    for prefix, api in REQUEST_ID_PREFIXES.items():
        if request_id.startswith(prefix):
            return api
    return None


def status_class(status: int) -> str:
    """200 -> "2xx", 404 -> "4xx"."""
    return f"{status // 100}xx"


class APILabelMiddleware:
    """ASGI middleware: labels a generation request with its API (`request.state.api`,
    which the access log prints) and counts it once its response starts."""

    def __init__(self, app, metrics: Any):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        api = GENERATION_APIS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if api is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})["api"] = api

        async def send_counted(message):
            if message["type"] == "http.response.start":
                self.metrics.record_api_request(api, status_class(message["status"]))
            await send(message)

        await self.app(scope, receive, send_counted)
