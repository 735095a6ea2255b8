"""OpenAI-compatible request and response models (pydantic), as served and documented.

Requests forbid unknown fields: a field we do not know is a 400 naming it, never
silently ignored. Fields we know but do not support yet (tools, response_format
other than text, suffix, best_of != n, ...) are declared so that `unsupported_field()`
can name them; everything else declared here is honoured.

Hostile input stops here: every integer is a signed 64-bit one (the engine core's wire
format and tensors hold nothing wider) and numbers must be finite (no NaN/Infinity).
Operator caps (n, logprobs, prompts per request) are checked by the handlers.

Value ranges the engine checks (with messages naming the field) are documented in the
schema (`_doc_range`) but not enforced by pydantic, so a client sees the engine's
message; the server fills in its own caps (n, logprobs, max_tokens) when it serves
/openapi.json.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

Int64 = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]


def _doc_range(**bounds: float) -> dict[str, Any]:
    """`json_schema_extra` documenting a range (JSON Schema keywords) without enforcing it."""
    return {"json_schema_extra": {
        {"exclusive_minimum": "exclusiveMinimum"}.get(k, k): v for k, v in bounds.items()}}


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error object; every non-2xx response (and a failed stream) carries one."""

    error: ErrorInfo


# ---------------------------------------------------------------------- shared
class StreamOptions(OpenAIRequest):
    include_usage: bool = Field(False, description="Send a final chunk with usage and no choices.")


class PromptTokensDetails(OpenAIResponse):
    cached_tokens: int = 0


class UsageInfo(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class JSONSchemaFormat(OpenAIRequest):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field("response", description="The schema's name (OpenAI requires one).")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(
        None, alias="schema", description="The JSON schema the output must match.")
    strict: bool | None = Field(None, description="Accepted; outputs always match the schema.")


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIRequest):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    model_config = ConfigDict(populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(
        None, alias="json", description="A JSON schema (object or JSON text).")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="An EBNF grammar (xgrammar's dialect).")
    json_object: bool | None = None


class SamplingFields(OpenAIRequest):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="A served model name; omitted: the served model.")
    max_tokens: Int64 | None = Field(
        None, description="Tokens to generate at most; default: the rest of the context.",
        **_doc_range(minimum=1))
    max_completion_tokens: Int64 | None = Field(
        None, description="Alias of max_tokens (wins).", **_doc_range(minimum=1))
    temperature: float | None = Field(None, description="0 is greedy; default 1.",
                                      **_doc_range(minimum=0))
    top_p: float | None = Field(None, **_doc_range(exclusive_minimum=0, maximum=1))
    top_k: Int64 | None = Field(None, description="Keep the k most likely tokens; 0 or -1: all.")
    min_p: float | None = Field(None, **_doc_range(minimum=0, maximum=1))
    seed: Int64 | None = Field(None, description="Reproducible sampling; n samples derive n seeds.")
    n: Annotated[int, Field(ge=1, le=(1 << 63) - 1)] = Field(
        1, description="Choices to generate for each prompt (at most the server's --max-n).")
    stop: str | list[str] | None = Field(None, description="Stop strings (not included).")
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(None, **_doc_range(minimum=-2, maximum=2))
    frequency_penalty: float | None = Field(None, **_doc_range(minimum=-2, maximum=2))
    repetition_penalty: float | None = Field(None, **_doc_range(exclusive_minimum=0))
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100].",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}})
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = Field(0, **_doc_range(minimum=0))
    skip_special_tokens: bool = True
    user: str | None = None
    cache_salt: str | None = Field(
        None, description="Isolates this request's prefix-cache entries from other salts.")
    priority: Int64 = Field(
        0, description="Lower runs first under the priority scheduling policy.")
    # Structured outputs (server/chat/structured_outputs.py): at most one of these.
    response_format: ResponseFormat | None = Field(
        None, description="{'type': 'json_object'} or {'type': 'json_schema', ...}.")
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | bool | str | None = Field(
        None, description="Alias of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="Alias of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(
        None, description="Alias of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Alias of structured_outputs.grammar.")
    # SGLang's dialect, which routers in front of vLLM (vllm-router) add to every request
    # they forward: honoured, or a 400 naming the field where it asks for what this
    # server does not do (see `dialect_unsupported`).
    no_stop_trim: bool = Field(
        False, description="SGLang's name: true keeps the matched stop string in the "
        "output, as include_stop_str_in_output does.")
    return_hidden_states: bool = Field(False, description="SGLang's; only false is supported.")

    def dialect_unsupported(self) -> tuple[str, str] | None:
        """The first field of another dialect whose value asks for something this server
        does not do; other dialects' fields at their defaults are accepted (a router adds
        them to every request), and an unknown field is still a 400."""
        if self.return_hidden_states:
            return "return_hidden_states", "return_hidden_states is not supported."
        return None


# ---------------------------------------------------------------- completions
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Int64] | list[list[Int64]] = Field(
        ..., description="Text, a batch of texts, token ids, or a batch of token-id lists.")
    logprobs: Int64 | None = Field(None, description="Top logprobs per token (0..20).",
                                   **_doc_range(minimum=0, maximum=20))
    echo: bool = Field(False, description="Prepend the prompt to the returned text.")
    suffix: str | None = Field(None, description="Not supported (400 if set).")
    best_of: Int64 | None = Field(None, description="Only best_of == n is supported.")

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported."
        if (dialect := self.dialect_unsupported()) is not None:
            return dialect
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", f"best_of ({self.best_of}) different from n ({self.n}) is not supported."
        return None


class CompletionLogProbs(OpenAIResponse):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = Field(
        None, description="The stop string or stop token id that ended the choice.")


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIResponse):
    """One SSE chunk of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# ----------------------------------------------------------------------- chat
class ImageURL(OpenAIRequest):
    url: str = Field(..., description="A data URL (data:image/png;base64,...) or, when the "
                     "server allows remote images, an http(s) URL.")
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="Accepted; the model's processor decides the resolution.")


class ChatContentPart(OpenAIRequest):
    model_config = ConfigDict(extra="allow")  # the type decides; other types are refused

    type: str
    text: str | None = None
    image_url: ImageURL | None = Field(None, description="An 'image_url' part's image "
                                       "(vision models).")


class FunctionCall(OpenAIRequest):
    name: str
    arguments: str = Field(..., description="The arguments, as JSON text.")


class ToolCall(OpenAIRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(None, description="A tool turn: the call it answers.")
    reasoning_content: str | None = Field(
        None, description="An assistant turn's reasoning (accepted, not sent to the model).")


class FunctionDefinition(OpenAIRequest):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments object.")
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: str


class NamedToolChoice(OpenAIRequest):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = Field(False, description="Return the chosen tokens' logprobs.")
    top_logprobs: Int64 | None = Field(None, description="Alternatives per token (0..20).",
                                       **_doc_range(minimum=0, maximum=20))
    add_generation_prompt: bool = Field(
        True, description="End the templated prompt with the assistant's turn header.")
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: 'auto' with tools, 'none' without.")
    parallel_tool_calls: bool | None = Field(
        None, description="Allow more than one call per turn (default true).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template, e.g. "
                          "{'enable_thinking': false}.")
    functions: list[dict[str, Any]] | None = Field(None, description="Not supported (400 if set).")
    function_call: str | dict[str, Any] | None = Field(None, description="Not supported.")
    # vLLM's and SGLang's chat extras that routers forward at their defaults.
    continue_final_message: bool = Field(
        False, description="vLLM's: the prompt ends inside the last message (no end-of-turn "
        "marker) and the model continues it; requires add_generation_prompt false.")
    include_reasoning: bool = Field(
        True, description="vLLM's; only true is supported (reasoning_content with "
        "--reasoning-parser).")
    separate_reasoning: bool = Field(True, description="SGLang's; only true is supported.")
    stream_reasoning: bool = Field(True, description="SGLang's; only true is supported.")

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "functions are not supported."
        if (dialect := self.dialect_unsupported()) is not None:
            return dialect
        for name in ("include_reasoning", "separate_reasoning", "stream_reasoning"):
            if not getattr(self, name):
                return name, f"{name} false is not supported."
        if self.function_call is not None:
            return "function_call", "function_call is not supported."
        for i, message in enumerate(self.messages):
            if isinstance(message.content, list):
                for j, part in enumerate(message.content):
                    if part.type == "image_url":
                        if part.image_url is None:
                            return f"messages[{i}].content[{j}]", (
                                "an 'image_url' part needs an 'image_url' object with a "
                                "'url'.")
                        continue
                    if part.type != "text" or part.text is None:
                        return f"messages[{i}].content", (
                            f"content parts of type {part.type!r} are not supported; only "
                            "'text' parts with a 'text' field and 'image_url' parts are.")
        return None


class ChatTopLogprob(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIResponse):
    content: list[ChatTokenLogprob] | None = None


class ResponseToolCall(OpenAIResponse):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIResponse):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer
    def _without_empty_extras(self) -> dict[str, Any]:
        data: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            data["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            data["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return data


class ChatCompletionChoice(OpenAIResponse):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIResponse):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _without_nones(self) -> dict[str, Any]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments))
                if v is not None}


class DeltaToolCall(OpenAIResponse):
    """A streamed piece of a tool call: the first of a call carries id, type and name."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None

    @model_serializer
    def _without_nones(self) -> dict[str, Any]:
        data: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            data.update(id=self.id, type=self.type or "function")
        if self.function is not None:
            data["function"] = self.function.model_dump()
        return data


class DeltaMessage(OpenAIResponse):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _without_nones(self) -> dict[str, Any]:
        data = {k: v for k, v in (("role", self.role), ("content", self.content),
                                  ("reasoning_content", self.reasoning_content))
                if v is not None}
        if self.tool_calls:
            data["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return data


class ChatCompletionStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIResponse):
    """One SSE chunk of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# --------------------------------------------------------------------- models
class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    # What unset sampling fields take on this server (the owner's and the model's
    # defaults: --generation-config, --override-generation-config, --max-tokens-default).
    sampling_defaults: dict[str, float | int] = Field(default_factory=dict)
    # Where its chat template came from: "the model's", "built-in gemma (the model has
    # none)", "--chat-template FILE", or "none ..." (chat requests are then a 400).
    chat_template: str | None = None


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------------------------ tokenizer
class TokenizeRequest(OpenAIRequest):
    """Either `prompt` (text) or `messages` (through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = Field(True, description="For `prompt`: add BOS etc.")
    add_generation_prompt: bool = Field(True, description="For `messages`.")
    # vLLM's; vllm-router sends it when it tokenizes a chat for cache-aware routing.
    continue_final_message: bool = Field(
        False, description="For `messages`: end inside the last message (vLLM's); requires "
        "add_generation_prompt false.")


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[Int64]


class DetokenizeResponse(OpenAIResponse):
    prompt: str


# ------------------------------------------------------------------ render (vLLM's)
class PlaceholderRange(OpenAIResponse):
    offset: int  # the image's first prompt position
    length: int  # positions in its run


class RenderedFeatures(OpenAIResponse):
    """Where a rendered prompt's images are: content hashes and placeholder runs."""

    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[PlaceholderRange]]


class RenderedRequest(OpenAIResponse):
    """vLLM's GenerateRequest: what /v1/chat/completions/render and /v1/completions/render
    answer (the prompt's token ids, its images, and the sampling parameters the request
    would run with), for routers and tools that tokenize through the server."""

    request_id: str
    token_ids: list[int]
    features: RenderedFeatures | None = None
    sampling_params: dict[str, Any]
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict[str, Any] | None = None


class VersionResponse(OpenAIResponse):
    version: str
