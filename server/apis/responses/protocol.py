"""OpenAI Responses API request and response models (POST /v1/responses, GET and DELETE
/v1/responses/{id}).

Like the other OpenAI routes, unknown top-level fields are a 400 naming them; fields
declared here are honoured, accepted as documented (metadata, include, service_tier,
...), or refused with a 400 (background, conversation, truncation 'auto'). Input items
keep unknown members (an earlier response's output items carry ids, status and
annotations, and clients send them back as they are).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.common.protocol import Int64, OpenAIRequest, _doc_range


class InputItem(BaseModel):
    """One item of `input`: a message (role + content; `type` "message" or omitted), a
    function_call, a function_call_output, or a reasoning item (dropped)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    type: Literal["message", "function_call", "function_call_output", "reasoning",
                  "item_reference"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | list[dict[str, Any]] | None = None  # function_call_output


class TextFormat(OpenAIRequest):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(None, description="Accepted; outputs always match the schema.")


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None
    verbosity: str | None = Field(None, description="Accepted; ignored.")


class FunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIRequest):
    type: Literal["function"]
    name: str


class ReasoningConfig(OpenAIRequest):
    effort: str | None = Field(
        None, description="'none' or 'minimal' renders the template without thinking "
                          "(enable_thinking: false); other values are accepted.")
    summary: str | None = Field(None, description="Accepted; the reasoning is sent whole.")
    generate_summary: str | None = None


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[InputItem] = Field(..., description="Text, or a list of input items.")
    instructions: str | None = Field(
        None, description="A system message first (not carried over by previous_response_id).")
    max_output_tokens: Int64 | None = Field(None, **_doc_range(minimum=1))
    temperature: float | None = Field(None, **_doc_range(minimum=0))
    top_p: float | None = Field(None, **_doc_range(exclusive_minimum=0, maximum=1))
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool = Field(True, description="Keep the response for GET and previous_response_id "
                                          "(in memory, --responses-store-size/-ttl).")
    previous_response_id: str | None = Field(
        None, description="Continue a stored response's conversation.")
    stream: bool = False
    stream_options: dict[str, Any] | None = Field(None, description="Accepted; ignored.")
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, description="Logged like `user`.")
    prompt_cache_key: str | None = Field(None, description="Accepted; ignored.")
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(None, description="Accepted; ignored.")
    truncation: Literal["disabled", "auto"] | None = Field(
        None, description="Only 'disabled' (a prompt that does not fit is a 400).")
    service_tier: str | None = Field(None, description="Accepted; ignored.")
    background: bool | None = Field(None, description="Only false.")
    conversation: str | dict[str, Any] | None = Field(None, description="Not supported.")


class ResponseObject(BaseModel):
    """A response (the fields clients read; output items as the API documents them)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None = None
    truncation: str = "disabled"
    usage: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
