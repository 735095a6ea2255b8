"""The Ollama API: /api/chat and /api/generate as a translation onto the chat path
(server/serving_chat.py), and the model listings (/api/tags, /api/show, /api/ps,
/api/version).

    Ollama request                       chat request
    messages (system/user/assistant/tool) -> the same roles; an assistant's tool_calls get
                                            ids (call_0, call_1, ...) that the following
                                            tool messages answer in order
    generate: system + prompt            -> a system and a user message; raw: the prompt's
                                            tokens as they are; context: its tokens first
    tools                                -> function tools (tool_choice auto)
    format "json" / a JSON schema        -> response_format json_object / json_schema
    options temperature, top_p, top_k, min_p, seed, stop, presence/frequency_penalty
                                         -> the same fields; repeat_penalty ->
                                            repetition_penalty; num_predict -> max_tokens
                                            (-1, -2: no limit); num_ctx -> a context limit
    think false                          -> chat_template_kwargs enable_thinking false

Answers: `message` (chat) or `response` (generate), `thinking` from --reasoning-parser,
whole tool calls (arguments an object), done_reason stop / length, and the timings
measured by the engine (RequestMetrics), in nanoseconds. Streams are NDJSON: one object
per piece, then the `done` object; tool calls come whole in a line before it. An empty
`messages` / `prompt` only "loads" the model (done_reason "load"), as in Ollama.
Model names may carry Ollama's default tag: "m:latest" is the served model "m".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from engine.request_output import RequestOutput
from server.chat_turn import TurnStream, collect_turn, stream_turn
from server.errors import APIError, bad_request, error_docs
from server.protocol_ollama import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaError,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaModel,
    OllamaModelDetails,
    OllamaOptions,
    OllamaOutMessage,
    OllamaOutToolCall,
    OllamaPs,
    OllamaRunningModel,
    OllamaShowRequest,
    OllamaShowResponse,
    OllamaTags,
    OllamaTimings,
    OllamaVersion,
)
from server.serving_chat import ChatRun, start_chat
from server.serving_common import apply_chat_template, chat_request, check_model
from server.state import ServerState
from server.tool_parsers import ToolCall, merge_deltas

NDJSON = "application/x-ndjson"
_DEFAULT_TAG = ":latest"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def served_name(state: ServerState, model: str) -> str:
    """The served model `model` names (a 404 if none): "m" or "m:latest"."""
    if model not in state.served_model_names and model.endswith(_DEFAULT_TAG):
        model = model[:-len(_DEFAULT_TAG)]
    check_model(state, model)
    return model


def _sampling_fields(state: ServerState, options: OllamaOptions | None) -> dict[str, Any]:
    if options is None:
        return {}
    if options.num_predict is not None and options.num_predict not in (-1, -2) \
            and options.num_predict < 1:
        raise bad_request(f"options.num_predict must be -1, -2 or at least 1, got "
                          f"{options.num_predict}.", "options.num_predict")
    if options.num_ctx is not None and not 1 <= options.num_ctx <= state.max_model_len:
        raise bad_request(f"options.num_ctx is {options.num_ctx}, but this server's context "
                          f"is {state.max_model_len} tokens (--max-model-len).",
                          "options.num_ctx")
    return {
        "temperature": options.temperature, "top_p": options.top_p, "top_k": options.top_k,
        "min_p": options.min_p, "seed": options.seed, "stop": options.stop,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
        "repetition_penalty": options.repeat_penalty,
        "max_tokens": options.num_predict if (options.num_predict or 0) > 0 else None,
    }


def _common_fields(state: ServerState, body: OllamaChatRequest | OllamaGenerateRequest,
                   messages: list[dict[str, Any]]) -> dict[str, Any]:
    fields: dict[str, Any] = {"model": served_name(state, body.model), "messages": messages,
                              **_sampling_fields(state, body.options)}
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "format", "schema": body.format}}
    if body.think is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.think is not False}
    return {name: value for name, value in fields.items() if value is not None}


def _chat_messages(body: OllamaChatRequest) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the last assistant's calls not yet answered
    next_id = 0
    for i, message in enumerate(body.messages):
        if message.images:
            raise bad_request("images are not supported.", f"messages[{i}].images")
        turn: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                call_id = call.id or f"call_{next_id}"
                next_id += 1
                arguments = call.function.arguments
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": arguments if isinstance(arguments, str)
                    else json.dumps(arguments)}})
            turn["tool_calls"] = calls
            pending = [call["id"] for call in calls]
        if message.role == "tool":
            turn["tool_call_id"] = message.tool_call_id or (pending.pop(0) if pending else "")
            if message.tool_name:
                turn["name"] = message.tool_name
        chat.append(turn)
    return chat


def _timings(final: RequestOutput, started_ns: int) -> dict[str, int]:
    m = final.metrics

    def span_ns(start: float | None, end: float | None) -> int:
        return max(0, int((end - start) * 1e9)) if start is not None and end is not None else 0

    return OllamaTimings(
        total_duration=time.perf_counter_ns() - started_ns,
        prompt_eval_count=final.num_prompt_tokens,
        prompt_eval_duration=span_ns(m.first_scheduled_time, m.first_token_time),
        eval_count=final.num_generation_tokens,
        eval_duration=span_ns(m.first_token_time, m.last_token_time),
    ).model_dump()


def _done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def _tool_calls(calls: list[ToolCall]) -> list[OllamaOutToolCall] | None:
    result = []
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = {}
        result.append(OllamaOutToolCall(function={
            "name": call.name, "arguments": arguments if isinstance(arguments, dict) else {}}))
    return result or None


def _line(data: dict[str, Any]) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def error_line(error: APIError) -> str:
    return _line({"error": error.message})


def _load_answer(body, chat: bool) -> dict[str, Any]:
    """Ollama's answer to an empty request: the model is loaded (it always is here)."""
    answer: dict[str, Any] = {"model": body.model, "created_at": _now(), "done": True,
                              "done_reason": "load"}
    if chat:
        answer["message"] = {"role": "assistant", "content": ""}
    else:
        answer["response"] = ""
    return answer


async def _answer(state: ServerState, raw_request: Request, run: ChatRun, model: str,
                  stream: bool, chat: bool, started_ns: int):
    """The response of a started chat or generate run (`chat`: a message, else text)."""
    if stream:
        return stream_turn(state, raw_request, run,
                           lambda turn: _lines(turn, model, chat, started_ns), error_line, NDJSON)
    turn = await collect_turn(state, run, raw_request)
    common = dict(model=model, created_at=_now(), done_reason=_done_reason(turn.finish_reason),
                  **_timings(turn.output, started_ns))
    if chat:
        return OllamaChatResponse(message=OllamaOutMessage(
            content=turn.content, thinking=turn.reasoning or None,
            tool_calls=_tool_calls(turn.tool_calls)), **common)
    output = turn.output
    return OllamaGenerateResponse(
        response=turn.content, thinking=turn.reasoning or None,
        context=list(output.prompt_token_ids) + list(output.outputs[0].token_ids), **common)


async def _lines(stream: TurnStream, model: str, chat: bool, started_ns: int
                 ) -> AsyncIterator[str]:
    calls = []
    async for piece in stream.pieces():
        delta = piece.delta
        calls.extend(delta.tool_calls)
        if delta.content or delta.reasoning:
            line: dict[str, Any] = {"model": model, "created_at": _now()}
            if chat:
                line["message"] = {"role": "assistant", "content": delta.content}
                if delta.reasoning:
                    line["message"]["thinking"] = delta.reasoning
            else:
                line["response"] = delta.content
                if delta.reasoning:
                    line["thinking"] = delta.reasoning
            yield _line({**line, "done": False})
        if piece.finish_reason is None:
            continue
        whole = _tool_calls(merge_deltas(calls))
        if chat and whole:
            yield _line({"model": model, "created_at": _now(), "message": {
                "role": "assistant", "content": "",
                "tool_calls": [c.model_dump() for c in whole]}, "done": False})
        final = stream.final
        done: dict[str, Any] = {"model": model, "created_at": _now()}
        if chat:
            done["message"] = {"role": "assistant", "content": ""}
        else:
            done["response"] = ""
        done.update(done=True, done_reason=_done_reason(piece.finish_reason),
                    **_timings(final, started_ns))
        if not chat:
            done["context"] = list(final.prompt_token_ids) + list(final.outputs[0].token_ids)
        yield _line(done)


async def ollama_chat(state: ServerState, body: OllamaChatRequest, raw_request: Request):
    started_ns = time.perf_counter_ns()
    fields = _common_fields(state, body, _chat_messages(body))
    if not body.messages:
        return _load_answer(body, chat=True)
    if body.tools:
        fields["tools"] = [tool.model_dump(exclude_none=True) for tool in body.tools]
    fields["stream"] = body.stream
    run = await start_chat(state, chat_request(fields), raw_request, id_prefix="ollama-chat",
                           max_context=(body.options.num_ctx if body.options else None))
    return await _answer(state, raw_request, run, body.model, body.stream, True, started_ns)


async def ollama_generate(state: ServerState, body: OllamaGenerateRequest, raw_request: Request):
    started_ns = time.perf_counter_ns()
    for name in ("suffix", "template"):
        if getattr(body, name):
            raise bad_request(f"{name} is not supported.", name)
    if body.images:
        raise bad_request("images are not supported.", "images")
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
        [{"role": "user", "content": body.prompt}]
    fields = _common_fields(state, body, messages)
    if not body.prompt:
        return _load_answer(body, chat=False)
    fields["stream"] = body.stream
    prompt_token_ids = None
    if body.raw:
        prompt_token_ids = list(state.tokenizer(body.prompt).input_ids)
    if body.context:
        if prompt_token_ids is None:
            _, prompt_token_ids = apply_chat_template(state, chat_request(fields).messages, True)
        prompt_token_ids = list(body.context) + prompt_token_ids
    run = await start_chat(state, chat_request(fields), raw_request, id_prefix="ollama-generate",
                           prompt_token_ids=prompt_token_ids,
                           max_context=(body.options.num_ctx if body.options else None))
    return await _answer(state, raw_request, run, body.model, body.stream, False, started_ns)


# ------------------------------------------------------------------ model listings
@functools.lru_cache(maxsize=8)
def _model_facts(model_root: str) -> tuple[int, str, str, OllamaModelDetails]:
    """(size in bytes, digest, modified_at, details) of the model's files.

    The digest is the SHA-256 of the file names, sizes and the config (an identity of
    this model directory, not a hash of the weights, which would take a while).
    """
    root = Path(model_root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    config: dict[str, Any] = {}
    config_path = root / "config.json"
    if config_path.is_file():
        digest.update(config_path.read_bytes())
        try:
            config = json.loads(config_path.read_text())
        except ValueError:
            config = {}
    modified = max((p.stat().st_mtime for p in files), default=os.path.getmtime(root))
    family = str(config.get("model_type") or "unknown")
    details = OllamaModelDetails(
        format="gguf" if any(p.suffix == ".gguf" for p in files) else "safetensors",
        family=family, families=[family])
    modified_at = datetime.fromtimestamp(modified, timezone.utc).isoformat()
    return size, digest.hexdigest(), modified_at.replace("+00:00", "Z"), details


def _tagged(name: str) -> str:
    return name if ":" in name else name + _DEFAULT_TAG


def _models(state: ServerState) -> list[OllamaModel]:
    size, digest, modified_at, details = _model_facts(state.model_root)
    return [OllamaModel(name=_tagged(name), model=_tagged(name), modified_at=modified_at,
                        size=size, digest=digest, details=details)
            for name in state.served_model_names]


def install_ollama_routes(app: FastAPI, state: ServerState, auth: list, generate: Callable,
                          version: str) -> None:
    """The /api/* routes (`generate`: app.py's error mapping; `version`: /api/version's)."""
    errors = error_docs(OllamaError)
    streamed = {"description": "With `stream: true` (the default): NDJSON, one object per "
                               "line, the last with `done: true` (or an `error` line).",
                "content": {NDJSON: {}}}

    # Like Ollama, answers leave out empty fields (thinking, tool_calls, context).
    @app.post("/api/chat", response_model=OllamaChatResponse, dependencies=auth,
              response_model_exclude_none=True, responses={**errors, 200: streamed})
    async def api_chat(body: OllamaChatRequest, raw_request: Request):
        return await generate(ollama_chat, state, body, raw_request)

    @app.post("/api/generate", response_model=OllamaGenerateResponse, dependencies=auth,
              response_model_exclude_none=True, responses={**errors, 200: streamed})
    async def api_generate(body: OllamaGenerateRequest, raw_request: Request):
        return await generate(ollama_generate, state, body, raw_request)

    @app.get("/api/tags", response_model=OllamaTags, dependencies=auth, responses=errors)
    async def api_tags() -> OllamaTags:
        return OllamaTags(models=_models(state))

    @app.get("/api/ps", response_model=OllamaPs, dependencies=auth, responses=errors)
    async def api_ps() -> OllamaPs:
        return OllamaPs(models=[OllamaRunningModel(
            **model.model_dump(), expires_at="2999-12-31T23:59:59Z", size_vram=0,
            context_length=state.max_model_len) for model in _models(state)])

    @app.post("/api/show", response_model=OllamaShowResponse, dependencies=auth,
              responses=errors)
    async def api_show(body: OllamaShowRequest) -> OllamaShowResponse:
        name = body.model or body.name
        if not name:
            raise bad_request("Missing required parameter: 'model'.", "model")
        served_name(state, name)
        _, _, modified_at, details = _model_facts(state.model_root)
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
