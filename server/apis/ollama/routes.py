"""The Ollama routes: /api/chat and /api/generate (server/apis/ollama/translator.py), the
model listings (/api/tags, /api/ps, /api/show) and /api/version."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute

from server.apis.contract import answer, serve_turn, streamed_doc
from server.apis.ollama.listings import model_facts, models_of
from server.apis.ollama.protocol import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaError,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaPs,
    OllamaRunningModel,
    OllamaShowRequest,
    OllamaShowResponse,
    OllamaTags,
    OllamaVersion,
)
from server.apis.ollama.translator import (
    NDJSON,
    ChatTranslator,
    GenerateTranslator,
    served_name,
)
from server.common.errors import bad_request, error_docs
from server.common.state import ServerState


async def _generation(state: ServerState, translator, empty: bool, raw_request: Request):
    """An empty request only "loads" the model (done_reason "load"), as in Ollama."""
    if empty:
        return translator.load_answer()
    return await serve_turn(state, translator, raw_request)


class AnyContentTypeRoute(APIRoute):
    """Ollama reads a request body as JSON whatever its Content-Type (`curl -d` sends
    application/x-www-form-urlencoded, as Ollama's own docs write it); FastAPI parses JSON
    only when the type says so, so other types are rewritten to application/json."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            content_type = request.headers.get("content-type", "")
            if request.method == "POST" and "json" not in content_type.lower():
                scope = dict(request.scope)
                scope["headers"] = [(k, v) for k, v in scope["headers"]
                                    if k.lower() != b"content-type"]
                scope["headers"].append((b"content-type", b"application/json"))
                request = Request(scope, request.receive)
            return await handler(request)

        return route


def install_routes(app: FastAPI, state: ServerState, auth: list, version: str) -> None:
    """The /api/* routes (`version`: /api/version's)."""
    router = APIRouter(route_class=AnyContentTypeRoute)
    errors = error_docs(OllamaError)
    streamed = streamed_doc(errors, "With `stream: true` (the default): NDJSON, one object "
                                    "per line, the last with `done: true` (or an `error` line).",
                            NDJSON)

    # Like Ollama, answers leave out empty fields (thinking, tool_calls, context).
    @router.post("/api/chat", response_model=OllamaChatResponse, dependencies=auth,
              response_model_exclude_none=True, responses=streamed)
    async def api_chat(body: OllamaChatRequest, raw_request: Request):
        return await answer(raw_request, _generation(
            state, ChatTranslator(state, body), not body.messages, raw_request))

    @router.post("/api/generate", response_model=OllamaGenerateResponse, dependencies=auth,
              response_model_exclude_none=True, responses=streamed)
    async def api_generate(body: OllamaGenerateRequest, raw_request: Request):
        return await answer(raw_request, _generation(
            state, GenerateTranslator(state, body), not body.prompt, raw_request))

    @router.get("/api/tags", response_model=OllamaTags, dependencies=auth, responses=errors)
    async def api_tags() -> OllamaTags:
        return OllamaTags(models=models_of(state))

    @router.get("/api/ps", response_model=OllamaPs, dependencies=auth, responses=errors)
    async def api_ps() -> OllamaPs:
        return OllamaPs(models=[OllamaRunningModel(
            **model.model_dump(), expires_at="2999-12-31T23:59:59Z", size_vram=0,
            context_length=state.max_model_len) for model in models_of(state)])

    @router.post("/api/show", response_model=OllamaShowResponse, dependencies=auth,
              responses=errors)
    async def api_show(body: OllamaShowRequest) -> OllamaShowResponse:
        name = body.model or body.name
        if not name:
            raise bad_request("Missing required parameter: 'model'.", "model")
        served_name(state, name)
        facts = model_facts(state.model_root)
        template = getattr(state.tokenizer, "chat_template", None)  # the built-in one too
        capabilities = ["completion"]
        if state.tool_call_parser is not None:
            capabilities.append("tools")
        if state.reasoning_parser is not None:
            capabilities.append("thinking")
        return OllamaShowResponse(
            modelfile="", parameters="",
            template=template if isinstance(template, str) else "",
            details=facts.details, capabilities=capabilities, modified_at=facts.modified_at,
            model_info={"general.architecture": facts.details.family,
                        "general.parameter_count": facts.num_parameters,
                        f"{facts.details.family}.context_length": state.max_model_len})

    @router.get("/api/version", response_model=OllamaVersion)
    async def api_version() -> OllamaVersion:
        return OllamaVersion(version=version)

    app.include_router(router)
