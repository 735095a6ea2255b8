"""Chat messages to prompt tokens: the model's chat template, its kwargs, and the chat
request another API's translator builds."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from server.chat.images import part_image_url
from server.chat.tools import template_tool_calls
from server.chat.translate import content_text
from server.common.errors import bad_request, validation_error
from server.common.protocol import (
    ChatCompletionRequest,
    ChatMessage,
)
from server.common.state import ServerState


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """A ChatCompletionRequest from another API's translated fields; a 400 if invalid."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


def message_text(message: ChatMessage) -> str:
    """The text of a chat message's content (a string or text parts)."""
    return content_text(message.content)


def template_content(message: ChatMessage, content_format: str,
                     image_placeholder: str | None) -> Any:
    """A message's content as the chat template takes it: a list of parts ("openai"
    format: text parts, and {"type": "image"} where an image was) or a string (the text
    parts and, where an image was, the model's placeholder, joined by newlines).

    Example ("string", placeholder "<image>"): [image, text "What is it?"]
    -> "<image>\nWhat is it?"
    """
    content = message.content
    if not isinstance(content, list) or all(part_image_url(p) is None for p in content):
        text = message_text(message)
        return [{"type": "text", "text": text}] if content_format == "openai" else text
    if content_format == "openai":
        return [{"type": "image"} if part_image_url(p) is not None
                else {"type": "text", "text": p.text or ""} for p in content]
    return "\n".join(image_placeholder or "" if part_image_url(p) is not None else p.text or ""
                     for p in content)


# chat_template_kwargs: at most this much JSON, and never a name the server sets itself.
MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024


_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs`, checked: a 400 when too large or naming a reserved argument."""
    if not kwargs:
        return {}
    if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
        raise bad_request(f"chat_template_kwargs is larger than {MAX_TEMPLATE_KWARGS_CHARS} "
                          "characters of JSON.", "chat_template_kwargs", "invalid_value")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}.",
                          "chat_template_kwargs", "invalid_value")
    return kwargs


def apply_chat_template(state: ServerState, messages: Sequence[ChatMessage],
                        add_generation_prompt: bool, tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None,
                        continue_final_message: bool = False,
                        image_placeholder: str | None = None) -> tuple[str, list[int]]:
    """Render the messages with the model's chat template; returns (text, token ids).

    Image parts become the model's `image_placeholder` (see `template_content`); the
    caller expands them (server/chat/images.py).

    Assistant turns keep their `tool_calls` and tool turns their `tool_call_id`;
    `tools` and `template_kwargs` are passed to the template. With
    `continue_final_message` (vLLM's), the prompt ends inside the last message, without
    its end-of-turn marker, so that the model continues it (a prefilled answer); it
    excludes `add_generation_prompt`.
    """
    if continue_final_message and add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be "
                          "true (set add_generation_prompt to false).",
                          "continue_final_message", "invalid_value")
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("This model has no chat template (and no built-in one fits its "
                          "vocabulary): start the server with --chat-template, or use "
                          "/v1/completions.", "messages")
    conversation = []
    for message in messages:
        content = template_content(message, state.chat_content_format, image_placeholder)
        turn: dict[str, Any] = {"role": message.role, "content": content}
        if message.name:
            turn["name"] = message.name  # for templates that use it
        if message.tool_calls:
            turn["tool_calls"] = template_tool_calls(message.tool_calls)
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
        conversation.append(turn)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools or None,
            **(template_kwargs or {}))
    except Exception as exc:  # a template may raise on e.g. roles it does not accept
        raise bad_request(f"The chat template rejected the messages: {exc}", "messages") from exc
    # The template already wrote any BOS it wants.
    return text, list(tokenizer(text, add_special_tokens=False).input_ids)
