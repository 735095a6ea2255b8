"""POST /v1/messages (Anthropic Messages) and /v1/messages/count_tokens: a translation
onto the chat path (server/apis/contract.py), nothing more.

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

from collections.abc import AsyncIterator, Iterator
from typing import Any

from server.apis.anthropic.protocol import (
    AnthropicMessage,
    AnthropicMessageResponse,
    AnthropicUsage,
    CountTokensRequest,
    CountTokensResponse,
    ImageBlock,
    MessagesRequest,
)
from server.apis.contract import OneTurnTranslator, TurnRequest
from server.chat import translate
from server.chat.images import data_url, image_url_part
from server.chat.run import ChatRun
from server.chat.sampling import check_model
from server.chat.template import apply_chat_template, chat_request, check_template_kwargs
from server.chat.turn import BlockWriter, Segment, Turn, TurnStream
from server.common.errors import APIError, bad_request
from server.common.protocol import UsageInfo
from server.common.state import ServerState
from server.common.streaming import sse

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# finish_kind -> Anthropic's stop_reason
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens",
                 "stop_sequence": "stop_sequence", "stop": "end_turn"}


def _messages(system, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The chat messages of an Anthropic conversation (see the module doc)."""
    chat: list[dict[str, Any]] = []
    if system:
        chat.append({"role": "system", "content": translate.content_text(system)})
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            chat.append({"role": message.role, "content": message.content})
            continue
        texts, calls, parts = [], [], []  # parts: text and image parts, when images
        for j, block in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            if block.type == "text":
                texts.append(block.text)
                parts.append({"type": "text", "text": block.text})
            elif block.type == "image" and message.role == "user":
                parts.append(image_url_part(_image_url(block, where)))
            elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # earlier reasoning is not sent back to the model
            elif block.type == "tool_use" and message.role == "assistant":
                calls.append(translate.function_call(block.id, block.name, block.input))
            elif block.type == "tool_result" and message.role == "user":
                chat.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": translate.content_text(block.content)})
            else:
                raise bad_request(f"{block.type} blocks are not allowed in a {message.role} "
                                  "message.", where)
        if len(parts) > len(texts):  # it has images: the parts, in order
            chat.append({"role": message.role, "content": parts})
        elif texts or calls or message.role == "assistant":
            turn: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            chat.append(turn)
    return chat


def _image_url(block: ImageBlock, where: str) -> str:
    """An image block's source as a chat image URL (base64 data as a data URL)."""
    source = block.source
    if source.type == "base64":
        if not source.data:
            raise bad_request("a base64 image source needs 'data'.", f"{where}.source.data")
        return data_url(source.media_type, source.data)
    if not source.url:
        raise bad_request("a url image source needs 'url'.", f"{where}.source.url")
    return source.url


def _chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat-request fields that shape the prompt (messages, tools, template)."""
    fields: dict[str, Any] = {"model": body.model,
                              "messages": _messages(body.system, body.messages)}
    if body.tools:
        for i, tool in enumerate(body.tools):
            if tool.type not in (None, "custom"):
                raise bad_request(f"server tools (type {tool.type!r}) are not supported; "
                                  "only custom tools are.", f"tools[{i}].type")
        fields["tools"] = [translate.function_tool(tool.name, tool.description,
                                         tool.input_schema or {"type": "object"})
                           for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs a name.", "tool_choice.name")
            fields["tool_choice"] = translate.named_tool_choice(choice.name)
        else:
            fields["tool_choice"] = _TOOL_CHOICES[choice.type]
        if choice.disable_parallel_tool_use and body.tools:
            fields["parallel_tool_calls"] = False
    if body.tools and choice is None:
        fields["tool_choice"] = "auto"
    if body.thinking is not None:
        fields["chat_template_kwargs"] = translate.thinking_kwargs(body.thinking.type != "disabled")
    return fields


def _usage(usage: UsageInfo) -> AnthropicUsage:
    cached = translate.cached_tokens(usage)
    return AnthropicUsage(input_tokens=usage.prompt_tokens - cached,
                          output_tokens=usage.completion_tokens,
                          cache_read_input_tokens=cached)


def _stop(finish_reason: str | None, stop_reason: int | str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a turn's finish."""
    kind = translate.finish_kind(finish_reason, stop_reason)
    return _STOP_REASONS[kind], stop_reason if kind == "stop_sequence" else None


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id style: call_abc -> toolu_abc."""
    return "toolu_" + call_id.removeprefix("call_")


def _content(turn: Turn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if turn.reasoning:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content:
        blocks.append({"type": "text", "text": turn.content})
    for call in turn.tool_calls:
        blocks.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                       "input": translate.arguments_object(call.arguments)})
    return blocks


def count_tokens(state: ServerState, body: CountTokensRequest) -> CountTokensResponse:
    """The prompt's token count: the same template and tools as a message would use."""
    check_model(state, body.model)
    chat = chat_request(_chat_fields(body))
    tools = [tool.model_dump(exclude_none=True) for tool in chat.tools or []]
    _, tokens = apply_chat_template(state, chat.messages, True, tools,
                                    check_template_kwargs(chat.chat_template_kwargs))
    return CountTokensResponse(input_tokens=len(tokens))


def event(name: str, data: dict[str, Any]) -> str:
    """One Anthropic SSE event: `event: <name>` and its JSON data."""
    return f"event: {name}\n" + sse(translate.compact_json({"type": name, **data}))


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


class MessagesTranslator(OneTurnTranslator):
    """POST /v1/messages."""

    body: MessagesRequest

    def chat_request(self) -> TurnRequest:
        body = self.body
        fields = _chat_fields(body)
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences,
                      stream=body.stream)
        if body.output_config is not None and body.output_config.format is not None:
            fields["response_format"] = translate.json_schema_format(body.output_config.format.schema_,
                                                           "output")
        if body.metadata and isinstance(body.metadata.get("user_id"), str):
            fields["user"] = body.metadata["user_id"]
        return TurnRequest(chat_request(fields), id_prefix="msg")

    def response(self, run: ChatRun, turn: Turn) -> AnthropicMessageResponse:
        stop_reason, stop_sequence = _stop(turn.finish_reason, turn.stop_reason)
        return AnthropicMessageResponse(
            id=run.request_id, model=run.model_name, content=_content(turn),
            stop_reason=stop_reason, stop_sequence=stop_sequence, usage=_usage(turn.usage))

    def error_event(self, error: APIError) -> str:
        return event("error", {"error": {"type": error.anthropic_type,
                                         "message": error.message}})

    async def events(self, run: ChatRun, stream: TurnStream) -> AsyncIterator[str]:
        yield event("message_start", {"message": {
            "id": run.request_id, "type": "message", "role": "assistant",
            "model": run.model_name, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": run.num_prompt_tokens, "output_tokens": 0}}})
        yield event("ping", {})
        blocks = _ContentBlocks()
        async for piece in stream.pieces():
            for chunk in blocks.write_delta(piece.delta):
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
