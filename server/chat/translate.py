"""The pieces every API translator needs, written once: from an API's request to the chat
request's fields, and from a chat turn back to the API's own words.

    request side                                 response side
    content_text     text of content parts       finish_kind     why a turn ended
    json_schema_format / json_object_format      arguments_object  a call's arguments as
    thinking_kwargs  enable_thinking                               an object ({} if not JSON)
    function_tool / named_tool_choice            cached_tokens   prompt tokens read from cache
                                                 compact_json    one JSON line or event body

A new content-part type (images, audio) is added to `content_text`'s caller side once,
not to each API.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from server.common.errors import bad_request
from server.common.protocol import UsageInfo

TEXT_PART_TYPES = ("text", "input_text", "output_text")


def content_text(content: str | Sequence[Any] | None, where: str | None = None,
                 text_types: Sequence[str] = TEXT_PART_TYPES) -> str:
    """The text of a content string or of a list of text parts, joined by newlines.

    A part is a dict or an object with `type` and `text`. With `where`, a part whose type
    is not in `text_types` (or that has no text) is a 400 naming `where[i]`; without it,
    the parts' text is taken as it is (the request model has already checked them).

    Example: [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]
    -> "a\\nb"
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
        text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
        if where is not None and (kind not in text_types or not isinstance(text, str)):
            raise bad_request(f"content parts of type {kind!r} are not supported; only "
                              f"{' and '.join(text_types)} parts are.", f"{where}[{i}]")
        texts.append(text or "")
    return "\n".join(texts)


def json_schema_format(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """A chat `response_format` that constrains the output to `schema`."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def json_object_format() -> dict[str, Any]:
    """A chat `response_format` that constrains the output to some JSON object."""
    return {"type": "json_object"}


def thinking_kwargs(enabled: bool) -> dict[str, Any]:
    """`chat_template_kwargs` that turn a reasoning model's thinking on or off."""
    return {"enable_thinking": enabled}


def function_tool(name: str, description: str | None = None,
                  parameters: dict[str, Any] | None = None,
                  strict: bool | None = None) -> dict[str, Any]:
    """A chat function tool; fields left None are left out."""
    function = {"name": name, "description": description, "parameters": parameters,
                "strict": strict}
    return {"type": "function",
            "function": {key: value for key, value in function.items() if value is not None}}


def named_tool_choice(name: str) -> dict[str, Any]:
    """A chat `tool_choice` that forces a call of the tool `name`."""
    return {"type": "function", "function": {"name": name}}


def function_call(call_id: str, name: str, arguments: str | dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call (arguments: JSON text, or an object to write as it)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name,
                                                          "arguments": arguments}}


def arguments_object(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as an object, for APIs that carry an object, not text: the
    parsed JSON when it is an object, else {} (a call the model wrote badly)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def finish_kind(finish_reason: str | None, stop_reason: int | str | None = None) -> str:
    """Why a turn ended, in the words each API maps to its own:
    "tool_calls" | "length" (the output cap) | "stop_sequence" (a stop string matched) |
    "stop" (end of turn)."""
    if finish_reason == "tool_calls":
        return "tool_calls"
    if finish_reason == "length":
        return "length"
    if isinstance(stop_reason, str):
        return "stop_sequence"
    return "stop"


def cached_tokens(usage: UsageInfo) -> int:
    """The prompt tokens read from the prefix cache."""
    return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0


def compact_json(data: Any) -> str:
    """`data` as JSON with no spaces and non-ASCII kept (an NDJSON line, an event body)."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))
