"""Tools on chat completions: what `tools` + `tool_choice` make of a request.

    tool_choice        output                                  parsed by
    "none" (or none)   free text                               -
    "auto" (default)   free text; the model may call tools     --tool-call-parser (hermes,
                       in its own format                       llama3_json, mistral, ...;
                                                               default by family)
    "required"         grammar: [{"name", "parameters"}, ...]  RequiredToolStream
    {"function": f}    grammar: f's arguments object           NamedToolStream

"required" and a named function are enforced by a grammar built from the functions'
`parameters` schemas, so their arguments always validate. finish_reason is
"tool_calls" when "auto" or "required" produced calls; a named function ends "stop"
(as OpenAI does when the function is forced).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from engine.structured_output import StructuredOutputsParams
from server.chat.structured_outputs import check_params, requested_params, structured_outputs_of
from server.chat.tool_parsers import (
    NamedToolStream,
    RequiredToolStream,
    ToolStream,
    make_auto_stream,
)
from server.common.errors import bad_request
from server.common.protocol import ChatCompletionRequest, ChatTool

if TYPE_CHECKING:
    from engine.frontend.async_engine import AsyncEngine

ToolMode = Literal["none", "auto", "required", "named"]
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's tools shape its output."""

    mode: ToolMode = "none"
    # The grammar of "required" / named (None otherwise).
    structured_outputs: StructuredOutputsParams | None = None
    # The tools as the chat template sees them (None: no tools in the prompt).
    template_tools: list[dict[str, Any]] | None = None
    parser: str | None = None  # "auto": the tool-call parser
    parallel: bool = True
    function_name: str | None = None  # named

    def make_stream(self) -> ToolStream | None:
        """A fresh parser for one choice, or None when the output is plain text."""
        if self.mode == "named":
            return NamedToolStream(self.function_name)
        if self.mode == "required":
            return RequiredToolStream()
        if self.mode == "auto":
            return make_auto_stream(self.parser, self.parallel)
        return None


async def plan_output(body: ChatCompletionRequest, default_parser: str | None,
                      engine: AsyncEngine) -> tuple[ToolPlan, StructuredOutputsParams | None]:
    """The request's ToolPlan and the grammar its output follows (checked), if any.

    "required" / a named function bring their own grammar (then a response_format too is
    a 400); with "auto" and a response_format, the format decides and no calls are parsed.
    """
    plan = plan_tools(body, default_parser)
    if plan.structured_outputs is not None:
        if (requested := requested_params(body)) is not None:
            raise bad_request(f"tool_choice {plan.mode!r} cannot be combined with "
                              f"{requested[0]}.", "tool_choice", "invalid_value")
        await check_params("tools", plan.structured_outputs, engine)
        return plan, plan.structured_outputs
    structured_outputs = await structured_outputs_of(body, engine)
    if structured_outputs is not None and plan.mode == "auto":
        plan = replace(plan, mode="none", parser=None)
    return plan, structured_outputs


def plan_tools(body: ChatCompletionRequest, default_parser: str | None) -> ToolPlan:
    """The request's ToolPlan; a 400 naming the field for anything inconsistent."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise bad_request("tool_choice needs tools.", "tool_choice", "invalid_value")
        if body.parallel_tool_calls is not None:
            raise bad_request("parallel_tool_calls needs tools.", "parallel_tool_calls",
                              "invalid_value")
        return ToolPlan()
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools have duplicate function names.", "tools", "invalid_value")
    parallel = body.parallel_tool_calls is not False
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools]
    if choice == "none":
        return ToolPlan(template_tools=template_tools, parallel=parallel)
    if choice == "auto":
        if default_parser is None:
            raise bad_request(
                "tool_choice 'auto' needs a tool-call parser for this model; start the server "
                "with --tool-call-parser (hermes, llama3_json, mistral, phi4_mini_json or "
                "pythonic), or use 'required' or a "
                "named function.", "tool_choice", "unsupported_parameter")
        return ToolPlan("auto", None, template_tools, default_parser, parallel)
    if choice == "required":
        schema = _required_schema(tools, parallel)
        return ToolPlan("required", StructuredOutputsParams("json", json.dumps(schema)),
                        template_tools, parallel=parallel)
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools.",
                          "tool_choice", "invalid_value")
    schema = tool.function.parameters or _ANY_OBJECT
    return ToolPlan("named", StructuredOutputsParams("json", json.dumps(schema)),
                    template_tools, parallel=parallel, function_name=name)


def _required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """[{"name": <one of the functions>, "parameters": <its arguments>}, ...]"""
    calls = [{
        "type": "object",
        "properties": {"name": {"const": tool.function.name},
                       "parameters": tool.function.parameters or _ANY_OBJECT},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for tool in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def template_tool_calls(tool_calls) -> list[dict[str, Any]]:
    """An assistant turn's calls as chat templates expect them: arguments as a mapping
    when they are a JSON object (Qwen's and Llama's templates serialise them)."""
    result = []
    for call in tool_calls:
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = call.function.arguments
        result.append({"id": call.id, "type": "function",
                       "function": {"name": call.function.name, "arguments": arguments}})
    return result
