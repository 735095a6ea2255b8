"""POST /v1/messages (Anthropic Messages) and /v1/messages/count_tokens: a translation
onto the chat path (server/serving_chat.py), nothing more.

    Anthropic request                       chat request
    system (text or text blocks)        ->  a system message
    user text blocks, tool_result       ->  user message; each tool_result a tool message
                                            (tool_call_id = tool_use_id), before the text
    assistant text, tool_use blocks     ->  assistant message with tool_calls
    tools [{name, input_schema}]        ->  function tools
    tool_choice auto / any / tool / none ->  auto / required / named / none
    disable_parallel_tool_use           ->  parallel_tool_calls false
    max_tokens, stop_sequences, temperature, top_p, top_k -> the same sampling fields
    output_config.format (json_schema)  ->  response_format json_schema
    thinking {"type": "disabled"}       ->  chat_template_kwargs enable_thinking false

    chat turn                           Anthropic response
    reasoning (--reasoning-parser)  ->  a thinking block (empty signature)
    content                         ->  a text block
    tool calls                      ->  tool_use blocks (input: the arguments object)
    finish stop / length / calls    ->  stop_reason end_turn (stop_sequence when a stop
                                        sequence matched) / max_tokens / tool_use

Usage follows Anthropic: input_tokens are the prompt tokens not read from the prefix
cache, cache_read_input_tokens the ones that were. Streams send Anthropic's events
(message_start, ping, content_block_start/delta/stop, message_delta, message_stop; an
`error` event when the request fails midway).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request

from server.chat_turn import (
    BlockWriter,
    Segment,
    Turn,
    TurnStream,
    collect_turn,
    segments,
    stream_turn,
)
from server.errors import APIError, bad_request, error_docs
from server.protocol import UsageInfo
from server.protocol_anthropic import (
    AnthropicErrorResponse,
    AnthropicMessage,
    AnthropicMessageResponse,
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    TextBlock,
)
from server.serving_chat import start_chat
from server.serving_common import (
    apply_chat_template,
    chat_request,
    check_model,
    check_template_kwargs,
    sse,
)
from server.state import ServerState

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _text_of(blocks: str | list[TextBlock]) -> str:
    """The text of a string or of text blocks."""
    if isinstance(blocks, str):
        return blocks
    return "\n".join(block.text for block in blocks)


def _messages(system, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The chat messages of an Anthropic conversation (see the module doc)."""
    chat: list[dict[str, Any]] = []
    if system:
        chat.append({"role": "system", "content": _text_of(system)})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        texts, calls = [], []
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                texts.append(block.text)
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier reasoning is not sent back to the model
            elif block.type == "tool_use" and message.role == "assistant":
                calls.append({"id": block.id, "type": "function", "function": {
                    "name": block.name, "arguments": json.dumps(block.input)}})
            elif block.type == "tool_result" and message.role == "user":
                chat.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": _text_of(block.content)})
            else:
                raise bad_request(f"{block.type} blocks are not allowed in a {message.role} "
                                  "message.", where)
        if texts or calls or message.role == "assistant":
            turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            chat.append(turn)
    return chat


def _chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat-request fields that shape the prompt (messages, tools, template)."""
    fields: dict[str, Any] = {"model": body.model,
                              "messages": _messages(body.system, body.messages)}
    if body.tools:
        for i, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"server tools (type {tool.type!r}) are not supported; "
                                  "only custom tools are.", f"tools[{i}].type")
        fields["tools"] = [{"type": "function", "function": {
            "name": tool.name, "description": tool.description,
            "parameters": tool.input_schema or {"type": "object"}}} for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs a name.", "tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = _TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use and body.tools:
            fields["parallel_tool_calls"] = False
    if body.tools and choice is None:
        fields["tool_choice"] = "auto"
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": body.thinking.type != "disabled"}
    return fields


def _usage(usage: UsageInfo) -> AnthropicUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return AnthropicUsage(input_tokens=usage.prompt_tokens - cached,
                          output_tokens=usage.completion_tokens,
                          cache_read_input_tokens=cached)


def _stop(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a turn's finish."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id style: call_abc -> toolu_abc."""
    return "toolu_" + call_id.removeprefix("call_")


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _content(turn: Turn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if turn.reasoning:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content:
        blocks.append({"type": "text", "text": turn.content})
    for call in turn.tool_calls:
        blocks.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                       "input": _tool_input(call.arguments)})
    return blocks


async def create_message(state: ServerState, body: MessagesRequest, raw_request: Request):
    fields = _chat_fields(body)
    fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                  top_k=body.top_k, stop=body.stop_sequences, stream=body.stream)
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    if body.metadata and isinstance(body.metadata.get("user_id"), str):
        fields["user"] = body.metadata["user_id"]
    run = await start_chat(state, chat_request(fields), raw_request, id_prefix="msg")
    if body.stream:
        return stream_turn(state, raw_request, run,
                           lambda stream: _events(state, stream, run.request_id), error_event)
    turn = await collect_turn(state, run, raw_request)
    stop_reason, stop_sequence = _stop(turn.finish_reason, turn.stop_reason)
    return AnthropicMessageResponse(
        id=run.request_id, model=state.model_name, content=_content(turn),
        stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(turn.usage))


async def count_tokens(state: ServerState, body: CountTokensRequest) -> CountTokensResponse:
    """The prompt's token count: the same template and tools as a message would use."""
    check_model(state, body.model)
    chat = chat_request(_chat_fields(body))
    tools = [tool.model_dump(exclude_none=True) for tool in chat.tools or []]
    _, tokens = apply_chat_template(state, chat.messages, True, tools,
                                    check_template_kwargs(chat.chat_template_kwargs))
    return CountTokensResponse(input_tokens=len(tokens))


def event(name: str, data: dict[str, Any]) -> str:
    """One Anthropic SSE event: `event: <name>` and its JSON data."""
    return f"event: {name}\n" + sse(json.dumps({"type": name, **data}, ensure_ascii=False,
                                               separators=(",", ":")))


def error_event(error: APIError) -> str:
    return event("error", {"error": {"type": error.anthropic_type, "message": error.message}})


class _ContentBlocks(BlockWriter):
    def open(self, segment: Segment) -> Iterator[str]:
        if segment.kind == "reasoning":
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif segment.kind == "text":
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "tool_use", "id": _tool_use_id(segment.call.id or ""),
                     "name": segment.call.name or "", "input": {}}
        yield event("content_block_start", {"index": self.index, "content_block": block})

    def delta(self, segment: Segment) -> Iterator[str]:
        if segment.kind == "reasoning":
            delta = {"type": "thinking_delta", "thinking": segment.text}
        elif segment.kind == "text":
            delta = {"type": "text_delta", "text": segment.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": segment.text}
        yield event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> Iterator[str]:
        if self.key is not None and self.key[0] == "reasoning":
            yield event("content_block_delta", {"index": self.index, "delta": {
                "type": "signature_delta", "signature": ""}})
        yield event("content_block_stop", {"index": self.index})


async def _events(state: ServerState, stream: TurnStream, message_id: str
                  ) -> AsyncIterator[str]:
    yield event("message_start", {"message": {
        "id": message_id, "type": "message", "role": "assistant", "model": state.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": stream.run.num_prompt_tokens, "output_tokens": 0}}})
    yield event("ping", {})
    blocks = _ContentBlocks()
    async for piece in stream.pieces():
        for segment in segments(piece.delta):
            for chunk in blocks.write(segment):
                yield chunk
        if piece.finish_reason is None:
            continue
        for chunk in blocks.end():
            yield chunk
        stop_reason, stop_sequence = _stop(piece.finish_reason, piece.stop_reason)
        yield event("message_delta", {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(stream.usage).model_dump()})
        yield event("message_stop", {})


def install_anthropic_routes(app: FastAPI, state: ServerState, auth: list,
                             generate: Callable) -> None:
    """POST /v1/messages and /v1/messages/count_tokens (`generate`: app.py's error mapping)."""
    errors = error_docs(AnthropicErrorResponse)

    @app.post("/v1/messages", response_model=AnthropicMessageResponse, dependencies=auth,
              responses={**errors, 200: {"description": (
                  "The message. With `stream: true`: `text/event-stream` of Anthropic's "
                  "events (message_start, content_block_*, message_delta, message_stop)."),
                  "content": {"text/event-stream": {}}}})
    async def messages(body: MessagesRequest, raw_request: Request):
        return await generate(create_message, state, body, raw_request)

    @app.post("/v1/messages/count_tokens", response_model=CountTokensResponse,
              dependencies=auth, responses=errors)
    async def messages_count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await count_tokens(state, body)
