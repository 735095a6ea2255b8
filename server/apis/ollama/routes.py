"""The Ollama routes: /api/chat and /api/generate (server/apis/ollama/translator.py), the
model listings (/api/tags, /api/ps, /api/show) and /api/version."""

from __future__ import annotations

from fastapi import FastAPI, Request

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


def install_routes(app: FastAPI, state: ServerState, auth: list, version: str) -> None:
    """The /api/* routes (`version`: /api/version's)."""
    errors = error_docs(OllamaError)
    streamed = streamed_doc(errors, "With `stream: true` (the default): NDJSON, one object "
                                    "per line, the last with `done: true` (or an `error` line).",
                            NDJSON)

    # Like Ollama, answers leave out empty fields (thinking, tool_calls, context).
    @app.post("/api/chat", response_model=OllamaChatResponse, dependencies=auth,
              response_model_exclude_none=True, responses=streamed)
    async def api_chat(body: OllamaChatRequest, raw_request: Request):
        return await answer(raw_request, _generation(
            state, ChatTranslator(state, body), not body.messages, raw_request))

    @app.post("/api/generate", response_model=OllamaGenerateResponse, dependencies=auth,
              response_model_exclude_none=True, responses=streamed)
    async def api_generate(body: OllamaGenerateRequest, raw_request: Request):
        return await answer(raw_request, _generation(
            state, GenerateTranslator(state, body), not body.prompt, raw_request))

    @app.get("/api/tags", response_model=OllamaTags, dependencies=auth, responses=errors)
    async def api_tags() -> OllamaTags:
        return OllamaTags(models=models_of(state))

    @app.get("/api/ps", response_model=OllamaPs, dependencies=auth, responses=errors)
    async def api_ps() -> OllamaPs:
        return OllamaPs(models=[OllamaRunningModel(
            **model.model_dump(), expires_at="2999-12-31T23:59:59Z", size_vram=0,
            context_length=state.max_model_len) for model in models_of(state)])

    @app.post("/api/show", response_model=OllamaShowResponse, dependencies=auth,
              responses=errors)
    async def api_show(body: OllamaShowRequest) -> OllamaShowResponse:
        name = body.model or body.name
        if not name:
            raise bad_request("Missing required parameter: 'model'.", "model")
        served_name(state, name)
        _, _, modified_at, details = model_facts(state.model_root)
        capabilities = ["completion"]
        if state.tool_call_parser is not None:
            capabilities.append("tools")
        if state.reasoning_parser is not None:
            capabilities.append("thinking")
        return OllamaShowResponse(
            modelfile="", parameters="",
            template=getattr(state.tokenizer, "chat_template", None) or "",
            details=details, capabilities=capabilities, modified_at=modified_at,
            model_info={"general.architecture": details.family,
                        f"{details.family}.context_length": state.max_model_len})

    @app.get("/api/version", response_model=OllamaVersion)
    async def api_version() -> OllamaVersion:
        return OllamaVersion(version=version)
