"""Ollama API request and response models (/api/chat, /api/generate, /api/tags, /api/show,
/api/ps, /api/version).

Like Ollama, unknown fields and unknown `options` (num_gpu, mirostat, ...) are ignored;
the declared ones are honoured or refused with a 400 (server/apis/ollama/translator.py).
Durations are nanoseconds, as Ollama reports them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.common.protocol import Int64


class OllamaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class OllamaOptions(OllamaRequest):
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: Int64 | None = None
    min_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})
    num_predict: Int64 | None = Field(
        None, description="Tokens to generate at most; -1 or -2: up to the context's end.")
    num_ctx: Int64 | None = Field(
        None, description="The context length to use: at most the server's; the prompt must "
                          "fit and the output stops at it.", json_schema_extra={"minimum": 1})
    stop: list[str] | str | None = None
    seed: Int64 | None = None
    repeat_penalty: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0})
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class OllamaFunctionCall(OllamaRequest):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)


class OllamaToolCall(OllamaRequest):
    id: str | None = None
    function: OllamaFunctionCall


class OllamaMessage(OllamaRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(
        None, description="Base64 images (vision models), before the text.")
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = Field(None, description="A tool message: the tool it answers.")
    tool_call_id: str | None = None
    thinking: str | None = Field(None, description="Accepted; not sent to the model.")


class OllamaFunction(OllamaRequest):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class OllamaTool(OllamaRequest):
    type: Literal["function"] = "function"
    function: OllamaFunction


class _GenerationRequest(OllamaRequest):
    model: str
    format: Literal["", "json"] | dict[str, Any] | None = Field(
        None, description="'json', or a JSON schema the output must match.")
    options: OllamaOptions | None = None
    stream: bool = Field(True, description="NDJSON lines (the default), or one JSON object.")
    keep_alive: str | float | None = Field(None, description="Accepted; the model stays loaded.")
    think: bool | str | None = Field(
        None, description="false renders the template without thinking (enable_thinking).")


class OllamaChatRequest(_GenerationRequest):
    messages: list[OllamaMessage] = Field(
        default_factory=list, description="Empty: only load the model (done_reason 'load').")
    tools: list[OllamaTool] | None = None


class OllamaGenerateRequest(_GenerationRequest):
    prompt: str = Field("", description="Empty: only load the model (done_reason 'load').")
    system: str | None = None
    raw: bool = Field(False, description="Send the prompt as is, without the chat template.")
    context: list[Int64] | None = Field(
        None, description="A previous answer's `context`: its token ids come first.")
    suffix: str | None = Field(None, description="Not supported (400 if set).")
    template: str | None = Field(None, description="Not supported (400 if set).")
    images: list[str] | None = Field(
        None, description="Base64 images (vision models), before the text.")


class OllamaShowRequest(OllamaRequest):
    model: str | None = None
    name: str | None = Field(None, description="Older clients' name of `model`.")


class OllamaTimings(BaseModel):
    """The measured times of a finished answer (nanoseconds)."""

    total_duration: int = Field(0, description="Request arrival to the answer.")
    load_duration: int = Field(0, description="Always 0: the model stays loaded.")
    prompt_eval_count: int = 0
    prompt_eval_duration: int = Field(0, description="First scheduled to first token.")
    eval_count: int = 0
    eval_duration: int = Field(0, description="First token to last token.")


class OllamaOutToolCall(BaseModel):
    function: dict[str, Any]


class OllamaOutMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    thinking: str | None = None
    tool_calls: list[OllamaOutToolCall] | None = None


class OllamaChatResponse(OllamaTimings):
    model: str
    created_at: str
    message: OllamaOutMessage
    done: bool = True
    done_reason: str | None = None


class OllamaGenerateResponse(OllamaTimings):
    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool = True
    done_reason: str | None = None
    context: list[int] | None = None


class OllamaModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str = ""
    quantization_level: str = ""


class OllamaModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaRunningModel(OllamaModel):
    expires_at: str
    size_vram: int
    context_length: int


class OllamaTags(BaseModel):
    models: list[OllamaModel]


class OllamaPs(BaseModel):
    models: list[OllamaRunningModel]


class OllamaShowResponse(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaVersion(BaseModel):
    version: str


class OllamaError(BaseModel):
    error: str
