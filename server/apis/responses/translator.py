"""POST /v1/responses (OpenAI Responses), GET and DELETE /v1/responses/{id}: a
translation onto the chat path (server/apis/contract.py) plus the response store
(server/apis/responses/store.py; the routes are server/apis/responses/routes.py).

    Responses request                       chat request
    instructions                        ->  a system message first
    previous_response_id                ->  the stored conversation (its input and output)
                                            before this input; a miss is a 404
    input text / message items          ->  messages (input_text / output_text parts)
    function_call items                 ->  an assistant message's tool_calls
    function_call_output items          ->  tool messages (tool_call_id = call_id)
    tools (function), tool_choice, parallel_tool_calls -> the same
    text.format json_object / json_schema -> response_format
    max_output_tokens, temperature, top_p -> max_tokens, temperature, top_p
    reasoning.effort none / minimal     ->  chat_template_kwargs enable_thinking false

    chat turn                        output items
    reasoning (--reasoning-parser)   a reasoning item (content: reasoning_text)
    content                          a message item (one output_text part); also an empty
                                     one when the turn made nothing else
    tool calls                       function_call items (call_id, name, arguments)
    finish length                    status "incomplete", incomplete_details
                                     {"reason": "max_output_tokens"}

A stream sends the documented events (`event:` lines, each with a sequence_number):
response.created, response.in_progress, per item response.output_item.added, its
deltas (response.reasoning_text.delta, response.content_part.added +
response.output_text.delta, response.function_call_arguments.delta) and their .done
events, response.output_item.done, then response.completed (or response.incomplete);
a failure midway is an `error` event. There is no [DONE].
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from server.apis.contract import OneTurnTranslator, TurnRequest
from server.apis.responses.protocol import (
    InputItem,
    ResponseObject,
    ResponsesRequest,
)
from server.chat import translate
from server.chat.images import image_url_part
from server.chat.run import ChatRun
from server.chat.template import chat_request
from server.chat.tool_parsers import ToolCall
from server.chat.turn import (
    BlockWriter,
    Segment,
    Turn,
    TurnStream,
)
from server.common.errors import APIError, bad_request
from server.common.protocol import UsageInfo
from server.common.state import ServerState
from server.common.streaming import sse

_PART_TYPES = ("input_text", "output_text", "text")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message item's content: its text, or (with input_image parts) chat parts in
    order, each image as an image_url part."""
    if not isinstance(content, list) or not any(_part_type(p) == "input_image" for p in content):
        return translate.content_text(content, where, _PART_TYPES)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if _part_type(part) == "input_image":
            url = part.get("image_url") if isinstance(part, dict) else getattr(part, "image_url", None)
            if not isinstance(url, str) or not url:
                raise bad_request("an input_image part needs an image_url (a data URL, or an "
                                  "http(s) URL; file_id is not supported).", f"{where}[{j}]")
            parts.append(image_url_part(url))
        else:
            text = translate.content_text([part], where, _PART_TYPES)  # a 400 if not text
            parts.append({"type": "text", "text": text})
    return parts


def _part_type(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else getattr(part, "type", None)


def _input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """The chat messages of `input` (see the module doc)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            if item.role is None:
                raise bad_request("a message item needs a role.", f"{where}.role")
            messages.append({"role": item.role,
                             "content": _message_content(item.content, f"{where}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise bad_request("a function_call item needs a call_id and a name.", where)
            call = translate.function_call(item.call_id, item.name, item.arguments or "{}")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id:
                raise bad_request("a function_call_output item needs a call_id.", where)
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": translate.content_text(item.output, f"{where}.output", _PART_TYPES)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the model
        else:
            raise bad_request(f"input items of type {kind!r} are not supported.", where)
    return messages


def _chat_fields(state: ServerState, body: ResponsesRequest
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the chat request's fields, the conversation without instructions)."""
    if body.background:
        raise bad_request("background responses are not supported.", "background",
                          "unsupported_parameter")
    if body.conversation is not None:
        raise bad_request("conversation is not supported; use previous_response_id.",
                          "conversation", "unsupported_parameter")
    if body.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported; a prompt that does not fit "
                          "is an error.", "truncation", "unsupported_parameter")
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            raise APIError(404, f"Previous response with id '{body.previous_response_id}' "
                                "not found (never stored, deleted, or expired).",
                           "previous_response_id", "previous_response_not_found")
        history = list(stored.messages)
    conversation = history + _input_messages(body.input)
    if not conversation:
        raise bad_request("input has no messages.", "input", "invalid_value")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {
        "model": body.model, "messages": system + conversation, "stream": body.stream,
        "max_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "user": body.user or body.safety_identifier,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        fields["tools"] = [translate.function_tool(tool.name, tool.description, tool.parameters,
                                         tool.strict) for tool in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else \
            translate.named_tool_choice(choice.name)
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = translate.json_object_format()
    elif fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = translate.json_schema_format(fmt.schema_ or {},
                                                       fmt.name or "response")
    if body.reasoning is not None and body.reasoning.effort in ("none", "minimal"):
        fields["chat_template_kwargs"] = translate.thinking_kwargs(False)
    return {k: v for k, v in fields.items() if v is not None}, conversation


def _usage(state: ServerState, usage: UsageInfo, reasoning: str) -> dict[str, Any]:
    cached = translate.cached_tokens(usage)
    reasoning_tokens = (len(state.tokenizer(reasoning, add_special_tokens=False).input_ids)
                        if reasoning else 0)
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {
                "cached_tokens": cached},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                              usage.completion_tokens)},
            "total_tokens": usage.total_tokens}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _output_items(turn: Turn) -> list[dict[str, Any]]:
    """The output items; the last one is "incomplete" when max_output_tokens cut it."""
    items = []
    if turn.reasoning:
        items.append(_reasoning_item(_item_id("rs"), turn.reasoning, "completed"))
    if turn.content or not turn.tool_calls:
        items.append(_message_item(_item_id("msg"), turn.content, "completed"))
    for call in turn.tool_calls:
        items.append(_call_item(_item_id("fc"), call.id, call.name, call.arguments,
                                "completed"))
    items[-1]["status"] = _item_status(turn.finish_reason)
    return items


def _item_status(finish_reason: str | None) -> str:
    return "incomplete" if translate.finish_kind(finish_reason) == "length" else "completed"


def _assistant_messages(content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
    """The turn as the chat message a later previous_response_id continues from."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in calls]
    return [message]


class _Response:
    """The response object of one request, as it goes from created to finished."""

    def __init__(self, state: ServerState, body: ResponsesRequest, run: ChatRun):
        self.state, self.body, self.run = state, body, run
        self.id = "resp_" + run.request_id.removeprefix("resp-")

    def object(self, status: str, output: list[dict[str, Any]],
               usage: dict[str, Any] | None = None,
               finish_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format else None
        tool_choice = body.tool_choice or ("auto" if body.tools else "none")
        if status == "completed" and _item_status(finish_reason) == "incomplete":
            status = "incomplete"
        return ResponseObject(
            id=self.id, created_at=self.run.created, status=status,
            incomplete_details=({"reason": "max_output_tokens"} if status == "incomplete"
                                else None),
            instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            model=self.run.model_name, output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            reasoning=body.reasoning.model_dump() if body.reasoning else None,
            store=body.store, temperature=body.temperature, top_p=body.top_p,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                  else {"type": "text"}},
            tool_choice=(tool_choice if isinstance(tool_choice, str)
                         else tool_choice.model_dump()),
            tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
            usage=usage, user=body.user, metadata=body.metadata or {},
        ).model_dump()

    def store(self, response: dict[str, Any], conversation: list[dict[str, Any]],
              content: str, calls: list[ToolCall]) -> None:
        if self.body.store:
            self.state.responses.put(self.id, response,
                                     conversation + _assistant_messages(content, calls))


class _Events(BlockWriter):
    """The events of one streamed response; output items are the blocks."""

    def __init__(self, state: ServerState, response: _Response,
                 conversation: list[dict[str, Any]]):
        super().__init__()
        self.state, self.response, self.conversation = state, response, conversation
        self.sequence_number = 0
        self.items: list[dict[str, Any]] = []  # finished output items
        self.text = ""  # the open item's text (reasoning, content or arguments)
        self.item: dict[str, Any] = {}
        self.content = ""
        self.calls: list[ToolCall] = []
        self.reasoning = ""
        self.status = "completed"

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return f"event: {kind}\n" + sse(translate.compact_json(payload))

    def error(self, error: APIError) -> str:
        return self.event("error", code=error.code, message=error.message, param=error.param)

    def open(self, segment: Segment) -> Iterator[str]:
        self.text = ""
        where = {"output_index": self.index}
        if segment.kind == "reasoning":
            self.item = _reasoning_item(_item_id("rs"), "", "in_progress")
            self.item["content"] = []
            yield self.event("response.output_item.added", item=self.item, **where)
        elif segment.kind == "text":
            self.item = _message_item(_item_id("msg"), None, "in_progress")
            yield self.event("response.output_item.added", item=self.item, **where)
            yield self.event("response.content_part.added", item_id=self.item["id"],
                             content_index=0, part=_text_part(""), **where)
        else:
            call = segment.call
            self.item = _call_item(_item_id("fc"), call.id or "", call.name or "", "",
                                   "in_progress")
            yield self.event("response.output_item.added", item=self.item, **where)

    def delta(self, segment: Segment) -> Iterator[str]:
        self.text += segment.text
        where = {"item_id": self.item["id"], "output_index": self.index}
        if segment.kind == "reasoning":
            yield self.event("response.reasoning_text.delta", content_index=0,
                             delta=segment.text, **where)
        elif segment.kind == "text":
            yield self.event("response.output_text.delta", content_index=0,
                             delta=segment.text, logprobs=[], **where)
        else:
            yield self.event("response.function_call_arguments.delta", delta=segment.text,
                             **where)

    def close(self) -> Iterator[str]:
        kind, item, text = self.key[0], self.item, self.text
        where = {"item_id": item["id"], "output_index": self.index}
        if kind == "reasoning":
            self.reasoning += text
            yield self.event("response.reasoning_text.done", content_index=0, text=text,
                             **where)
            item = _reasoning_item(item["id"], text, self.status)
        elif kind == "text":
            self.content += text
            yield self.event("response.output_text.done", content_index=0, text=text,
                             logprobs=[], **where)
            yield self.event("response.content_part.done", content_index=0,
                             part=_text_part(text), **where)
            item = _message_item(item["id"], text, self.status)
        else:
            yield self.event("response.function_call_arguments.done", arguments=text,
                             name=item["name"], **where)
            item = _call_item(item["id"], item["call_id"], item["name"], text, self.status)
            self.calls.append(ToolCall(id=item["call_id"], name=item["name"], arguments=text))
        self.items.append(item)
        yield self.event("response.output_item.done", item=item, output_index=self.index)

    async def events(self, stream: TurnStream) -> AsyncIterator[str]:
        response = self.response
        yield self.event("response.created", response=response.object("in_progress", []))
        yield self.event("response.in_progress", response=response.object("in_progress", []))
        async for piece in stream.pieces():
            for chunk in self.write_delta(piece.delta):
                yield chunk
            if piece.finish_reason is None:
                continue
            self.status = _item_status(piece.finish_reason)  # of the last item
            for chunk in self.end():
                yield chunk
            if not any(item["type"] in ("message", "function_call") for item in self.items):
                # Nothing but reasoning (or nothing): an empty message, as when not streamed.
                if self.items:
                    self.items[-1]["status"] = "completed"
                for chunk in self.write(Segment("text", "")):
                    yield chunk
                for chunk in self.end():
                    yield chunk
            result = response.object("completed", self.items,
                                     _usage(self.state, stream.usage, self.reasoning),
                                     piece.finish_reason)
            response.store(result, self.conversation, self.content, self.calls)
            kind = "response.incomplete" if result["status"] == "incomplete" \
                else "response.completed"
            yield self.event(kind, response=result)


class ResponsesTranslator(OneTurnTranslator):
    """POST /v1/responses; a stored response keeps its conversation for a later
    previous_response_id."""

    body: ResponsesRequest

    def chat_request(self) -> TurnRequest:
        fields, self.conversation = _chat_fields(self.state, self.body)
        return TurnRequest(chat_request(fields), id_prefix="resp")

    def response(self, run: ChatRun, turn: Turn) -> dict[str, Any]:
        response = _Response(self.state, self.body, run)
        result = response.object("completed", _output_items(turn),
                                 _usage(self.state, turn.usage, turn.reasoning),
                                 turn.finish_reason)
        response.store(result, self.conversation, turn.content, turn.tool_calls)
        return result

    def events(self, run: ChatRun, stream: TurnStream) -> AsyncIterator[str]:
        self.writer = _Events(self.state, _Response(self.state, self.body, run),
                              self.conversation)
        return self.writer.events(stream)

    def error_event(self, error: APIError) -> str:
        return self.writer.error(error)
