"""The Ollama API's /api/chat and /api/generate as a translation onto the chat path
(server/apis/contract.py); the model listings are server/apis/ollama/listings.py.

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

import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from engine.request_output import RequestOutput
from engine.sampling_defaults import OLLAMA_DEFAULTS
from server.apis.contract import OneTurnTranslator, TurnRequest
from server.apis.ollama.protocol import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaOptions,
    OllamaOutMessage,
    OllamaOutToolCall,
    OllamaTimings,
)
from server.chat import translate
from server.chat.images import data_url, image_url_part
from server.chat.run import ChatRun
from server.chat.sampling import check_model
from server.chat.template import apply_chat_template, chat_request
from server.chat.tool_parsers import ToolCall, merge_deltas
from server.chat.turn import Turn, TurnStream
from server.common.errors import APIError, bad_request
from server.common.state import ServerState

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
        fields["response_format"] = translate.json_object_format()
    elif isinstance(body.format, dict):
        fields["response_format"] = translate.json_schema_format(body.format, "format")
    if body.think is not None:
        fields["chat_template_kwargs"] = translate.thinking_kwargs(body.think is not False)
    return {name: value for name, value in fields.items() if value is not None}


def _with_images(text: str | None, images: list[str] | None) -> str | list[dict[str, Any]]:
    """A message's content: its text, or (with Ollama's base64 `images`) the images, then
    the text, as chat parts."""
    if not images:
        return text or ""
    parts = [image_url_part(data_url(None, image)) for image in images]
    return [*parts, {"type": "text", "text": text or ""}]


def _chat_messages(body: OllamaChatRequest) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the last assistant's calls not yet answered
    next_id = 0
    for message in body.messages:
        turn: dict[str, Any] = {"role": message.role,
                                "content": _with_images(message.content, message.images)}
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                calls.append(translate.function_call(call.id or f"call_{next_id}", call.function.name,
                                           call.function.arguments))
                next_id += 1
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
    return "length" if translate.finish_kind(finish_reason) == "length" else "stop"


def _tool_calls(calls: list[ToolCall]) -> list[OllamaOutToolCall] | None:
    result = [OllamaOutToolCall(function={"name": call.name,
                                          "arguments": translate.arguments_object(call.arguments)})
              for call in calls]
    return result or None


def _line(data: dict[str, Any]) -> str:
    return translate.compact_json(data) + "\n"


class _OllamaTranslator(OneTurnTranslator):
    """/api/chat (`chat`: the answer is a message) and /api/generate (text)."""

    media_type = NDJSON
    chat: bool

    def __init__(self, state: ServerState, body: Any):
        super().__init__(state, body)
        self.started_ns = time.perf_counter_ns()

    def fields(self) -> dict[str, Any]:
        """The checked chat-request fields (a 400/404 in Ollama's names if bad)."""
        raise NotImplementedError

    def load_answer(self) -> dict[str, Any]:
        """Ollama's answer to an empty request, after the same checks as a real one: the
        model is loaded (it always is here)."""
        self.fields()
        answer: dict[str, Any] = {"model": self.body.model, "created_at": _now(),
                                  "done": True, "done_reason": "load"}
        if self.chat:
            answer["message"] = {"role": "assistant", "content": ""}
        else:
            answer["response"] = ""
        return answer

    def max_context(self) -> int | None:
        return self.body.options.num_ctx if self.body.options else None

    def error_event(self, error: APIError) -> str:
        return _line({"error": error.message})

    def response(self, run: ChatRun, turn: Turn):
        common = dict(model=self.body.model, created_at=_now(),
                      done_reason=_done_reason(turn.finish_reason),
                      **_timings(turn.output, self.started_ns))
        if self.chat:
            return OllamaChatResponse(message=OllamaOutMessage(
                content=turn.content, thinking=turn.reasoning or None,
                tool_calls=_tool_calls(turn.tool_calls)), **common)
        output = turn.output
        return OllamaGenerateResponse(
            response=turn.content, thinking=turn.reasoning or None,
            context=list(output.prompt_token_ids) + list(output.outputs[0].token_ids),
            **common)

    async def events(self, run: ChatRun, stream: TurnStream) -> AsyncIterator[str]:
        model, chat = self.body.model, self.chat
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
            final: RequestOutput = stream.final
            done: dict[str, Any] = {"model": model, "created_at": _now()}
            if chat:
                done["message"] = {"role": "assistant", "content": ""}
            else:
                done["response"] = ""
            done.update(done=True, done_reason=_done_reason(piece.finish_reason),
                        **_timings(final, self.started_ns))
            if not chat:
                done["context"] = list(final.prompt_token_ids) + \
                    list(final.outputs[0].token_ids)
            yield _line(done)


class ChatTranslator(_OllamaTranslator):
    """POST /api/chat."""

    chat = True
    body: OllamaChatRequest

    def fields(self) -> dict[str, Any]:
        return _common_fields(self.state, self.body, _chat_messages(self.body))

    def chat_request(self) -> TurnRequest:
        fields = self.fields()
        if self.body.tools:
            fields["tools"] = [tool.model_dump(exclude_none=True) for tool in self.body.tools]
        fields["stream"] = self.body.stream
        return TurnRequest(chat_request(fields), id_prefix="ollama-chat",
                           max_context=self.max_context(), api_defaults=OLLAMA_DEFAULTS)


class GenerateTranslator(_OllamaTranslator):
    """POST /api/generate."""

    chat = False
    body: OllamaGenerateRequest

    def fields(self) -> dict[str, Any]:
        body = self.body
        for name in ("suffix", "template"):
            if getattr(body, name):
                raise bad_request(f"{name} is not supported.", name)
        if body.images and (body.raw or body.context):
            raise bad_request("images cannot be sent with raw or context.", "images")
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": _with_images(body.prompt, body.images)}]
        return _common_fields(self.state, body, messages)

    def chat_request(self) -> TurnRequest:
        body, state = self.body, self.state
        fields = self.fields()
        fields["stream"] = body.stream
        prompt_token_ids = None
        if body.raw:
            prompt_token_ids = list(state.tokenizer(body.prompt).input_ids)
        if body.context:
            if prompt_token_ids is None:
                _, prompt_token_ids = apply_chat_template(state, chat_request(fields).messages,
                                                          True)
            prompt_token_ids = list(body.context) + prompt_token_ids
        return TurnRequest(chat_request(fields), id_prefix="ollama-generate",
                           prompt_token_ids=prompt_token_ids, max_context=self.max_context(),
                           api_defaults=OLLAMA_DEFAULTS)
