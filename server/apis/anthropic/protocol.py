"""Anthropic Messages request and response models (POST /v1/messages, /count_tokens).

Unknown top-level fields are ignored (Anthropic's clients add fields across versions,
e.g. `container`, `context_management`); every declared field is honoured or refused
with a 400 (server/apis/anthropic/translator.py). Content blocks are typed by their `type`:
text, image (user; vision models), tool_use (assistant), tool_result (user) and thinking
(assistant, dropped) are accepted; any other type (document, ...) is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from server.common.protocol import Int64


class AnthropicRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Block(AnthropicRequest):
    model_config = ConfigDict(extra="allow")  # cache_control, citations, ...


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageSource(AnthropicRequest):
    type: Literal["base64", "url"]
    media_type: str | None = None  # base64: image/jpeg, image/png, image/gif, image/webp
    data: str | None = None  # base64
    url: str | None = None  # url


class ImageBlock(_Block):
    """A user turn's image (base64 data, or a URL the server may fetch)."""

    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Block):
    """An assistant's call of a tool."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    """A user turn's answer to a tool_use (its content: text or text blocks)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(_Block):
    """An assistant's earlier reasoning (not sent back to the model)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock
                         | ThinkingBlock, Field(discriminator="type")]


_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class AnthropicMessage(AnthropicRequest):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_block_types(cls, content: Any) -> Any:
        """Name an unsupported block type (pydantic would report the union's first branch)."""
        if isinstance(content, list):
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in _BLOCK_TYPES:
                    raise ValueError(f"content blocks of type {kind!r} are not supported; "
                                     f"only {', '.join(_BLOCK_TYPES)} are")
        return content


class AnthropicTool(AnthropicRequest):
    model_config = ConfigDict(extra="allow")

    type: str | None = Field(None, description="'custom' or omitted; server tools are refused.")
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] | None = Field(
        None, description="A JSON schema of the tool's input object.")


class AnthropicToolChoice(AnthropicRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="type 'tool': the tool to call.")
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(AnthropicRequest):
    type: str = Field(..., description="'disabled' turns the template's thinking off; "
                                       "anything else leaves it on.")
    budget_tokens: Int64 | None = Field(None, description="Accepted; not enforced.")


class JSONOutputFormat(AnthropicRequest):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(AnthropicRequest):
    format: JSONOutputFormat | None = Field(
        None, description="Structured output: the text matches this JSON schema.")
    effort: str | None = Field(None, description="Accepted; ignored.")


class CountTokensRequest(AnthropicRequest):
    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = Field(
        None, description="{'type': 'disabled'} renders the template without thinking "
                          "(enable_thinking: false).")


class MessagesRequest(CountTokensRequest):
    max_tokens: Int64 = Field(..., description="Tokens to generate at most.",
                              json_schema_extra={"minimum": 1})
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: Int64 | None = None
    metadata: dict[str, Any] | None = Field(
        None, description="`user_id` is logged like OpenAI's `user`.")
    service_tier: str | None = Field(None, description="Accepted; ignored.")
    output_config: OutputConfig | None = None


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(
        ..., description="thinking, text and tool_use blocks, in output order.")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
