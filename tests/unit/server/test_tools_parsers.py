"""Tool-call and reasoning parsers, and the chat output they make: no model, no server.

Every parser is fed the same text split at every chunk size: the streamed pieces must
add up to the whole-text parse (what the non-streamed response carries).
"""

from __future__ import annotations

import json

import pytest

from server.chat.output import ChoiceParser, ParsedDelta
from server.chat.pythonic_calls import parse_pythonic_calls
from server.chat.reasoning import ThinkTagReasoningStream, make_reasoning_stream
from server.chat.tool_parsers import (
    HermesToolStream,
    Llama3JsonToolStream,
    MistralToolStream,
    NamedToolStream,
    Phi4MiniJsonToolStream,
    PythonicToolStream,
    RequiredToolStream,
    merge_deltas,
)
from server.chat.tools import ToolPlan, plan_tools
from server.common.errors import APIError
from server.common.protocol import ChatCompletionRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def streamed(make, text: str, size: int):
    stream, content, deltas = make(), "", []
    for i in range(0, len(text), size):
        piece, calls = stream.feed(text[i:i + size])
        content, deltas = content + piece, deltas + calls
    piece, calls = stream.finish()
    return content + piece, [(c.name, c.arguments) for c in merge_deltas(deltas + calls)]


def whole(make, text: str):
    content, calls = make().parse_all(text)
    return content, [(c.name, c.arguments) for c in calls]


CASES = [
    (RequiredToolStream, '[{"name": "get_weather", "parameters": {"city": "P}a\\"ris"}}, '
                         '{"name": "get_time", "parameters": {}}]',
     ("", [("get_weather", '{"city": "P}a\\"ris"}'), ("get_time", "{}")])),
    (lambda: NamedToolStream("get_weather"), '{"city": "Paris"}',
     ("", [("get_weather", '{"city": "Paris"}')])),
    (HermesToolStream, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                       '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                       '"arguments": {}}\n</tool_call>',
     ("Let me check.\n", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    (lambda: HermesToolStream(parallel=False),
     '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
     '"arguments": {}}</tool_call>', ("", [("a", "{}")])),
    (HermesToolStream, "No tools needed: 1 < 2 and <tool", ("No tools needed: 1 < 2 and <tool", [])),
    (Llama3JsonToolStream, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                           '{"name": "get_time", "parameters": {}}',
     ("", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])),
    (Llama3JsonToolStream, "Sunny, {probably}.", ("Sunny, {probably}.", [])),
    (Llama3JsonToolStream, '{"not": "a call"}', ('{"not": "a call"}', [])),
    (Llama3JsonToolStream, '{"name": "Ada", "age": 36}', ('{"name": "Ada", "age": 36}', [])),
    # Mistral: content, then [TOOL_CALLS] and a JSON array (a "]" inside a string is no end)
    (MistralToolStream, 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": '
                        '{"city": "P]aris"}}, {"name": "get_time", "arguments": {}}]',
     ("Checking. ", [("get_weather", '{"city": "P]aris"}'), ("get_time", "{}")])),
    # ... or, with v11+ tokenizers, name[ARGS]{...} after each [TOOL_CALLS]
    (MistralToolStream, '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time'
                        '[ARGS]{}', ("", [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")])),
    (lambda: MistralToolStream(parallel=False),
     '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]',
     ("", [("a", "{}")])),
    (MistralToolStream, "Plain [TOOL text, [1, 2].", ("Plain [TOOL text, [1, 2].", [])),
    # A block that holds no call (cut by max_tokens, or not JSON) stays content.
    (MistralToolStream, 'Hi[TOOL_CALLS][{"name": "a", "argu',
     ('Hi[TOOL_CALLS][{"name": "a", "argu', [])),
    (MistralToolStream, "[TOOL_CALLS] oops, not a call", ("[TOOL_CALLS] oops, not a call", [])),
    # Phi-4-mini: <|tool_call|> JSON list <|/tool_call|>, content around it; functools[...]
    (Phi4MiniJsonToolStream, 'Let me look.<|tool_call|>[{"name": "get_weather", "arguments": '
                             '{"city": "Rome"}}]<|/tool_call|> Done.',
     ("Let me look. Done.", [("get_weather", '{"city": "Rome"}')])),
    (Phi4MiniJsonToolStream, 'functools[{"name": "get_time", "parameters": {"tz": "UTC"}}, '
                             '{"type": "function", "function": {"name": "get_weather", '
                             '"arguments": "{\\"city\\": \\"Rome\\"}"}}]',
     ("", [("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "Rome"}')])),
    (Phi4MiniJsonToolStream, "Python's functools module: < | >", (
        "Python's functools module: < | >", [])),
    # Pythonic (Gemma 3): the whole output is a list of calls, possibly in a tool_code fence
    (PythonicToolStream, '[get_weather(city="Paris", days=-2, metric=True), tools.now()]',
     ("", [("get_weather", '{"city": "Paris", "days": -2, "metric": true}'),
           ("tools.now", "{}")])),
    (PythonicToolStream, '```tool_code\n[get_weather(city="Oslo", hours=[1, 2])]\n```',
     ("", [("get_weather", '{"city": "Oslo", "hours": [1, 2]}')])),
    (lambda: PythonicToolStream(parallel=False), "[a(x=1), b(y=null)]", ("", [("a", '{"x": 1}')])),
    (PythonicToolStream, "[1] Paris is the capital.", ("[1] Paris is the capital.", [])),
    (PythonicToolStream, "```python\nprint(1)\n```", ("```python\nprint(1)\n```", [])),
    (PythonicToolStream, "Sunny in Paris.", ("Sunny in Paris.", [])),
]


@pytest.mark.parametrize("make,text,expected", CASES)
def test_streamed_pieces_add_up_to_the_whole_parse(make, text, expected):
    assert whole(make, text) == expected
    for size in (1, 2, 3, 7, len(text)):
        assert streamed(make, text, size) == expected, size


def test_mistral_call_ids_are_nine_alphanumerics():
    """Mistral's chat templates refuse any other id when the call comes back."""
    _, calls = MistralToolStream().parse_all('[TOOL_CALLS][{"name": "a", "arguments": {}}]')
    assert len(calls[0].id) == 9 and calls[0].id.isalnum()


@pytest.mark.parametrize("text", [
    "[f(1)]",  # positional arguments
    "[f(**kw)]",
    "[f(x=g())]",  # a call as an argument: not a literal
    "[f(x=a + 1)]",
    "[(lambda: 1)()]",
    "[]",
    "f(x=1)",  # not a list
    "[f(x=1)",  # cut short
    "[f(x={1, 2})]",  # a set is no JSON value
])
def test_pythonic_refuses_what_is_not_a_list_of_literal_calls(text):
    assert parse_pythonic_calls(text) is None


def test_pythonic_reads_python_and_json_literals():
    text = "[f(s='it\\'s', n=None, t=true, d={'k': [1.5, -3]}, u=(1, 2))]"
    assert parse_pythonic_calls(text) == [
        ("f", '{"s": "it\'s", "n": null, "t": true, "d": {"k": [1.5, -3]}, "u": [1, 2]}')]


@pytest.mark.parametrize("text,expected", [
    ("<think>\nLet me think.\n</think>\n\nParis.", ("Let me think.\n", "Paris.")),
    ("Paris, no thinking.", ("", "Paris, no thinking.")),
    ("<think>cut off by max_tok", ("cut off by max_tok", "")),
    ("2 < 3 <thin", ("", "2 < 3 <thin")),
])
def test_reasoning_split(text, expected):
    assert ThinkTagReasoningStream().parse_all(text) == expected
    for size in (1, 2, 5):
        stream, reasoning, content = ThinkTagReasoningStream(), "", ""
        for i in range(0, len(text), size):
            r, c = stream.feed(text[i:i + size])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert (reasoning + r, content + c) == expected


def test_mistral_reasoning_split():
    stream = make_reasoning_stream("mistral")
    assert stream.parse_all("[THINK]Hmm.[/THINK]Paris.") == ("Hmm.", "Paris.")
    assert make_reasoning_stream("mistral").parse_all("Paris <think>") == ("", "Paris <think>")


def test_reasoning_and_tools_together_and_the_wire_format():
    plan = ToolPlan("auto", template_tools=[], parser="hermes")
    text = ('<think>Weather tool.</think>\n<tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Rome"}}</tool_call>')
    message = ChoiceParser("qwen3", plan).message(text)
    dumped = message.model_dump()
    assert dumped["content"] is None and dumped["reasoning_content"] == "Weather tool."
    [call] = dumped["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    parser = ChoiceParser("qwen3", plan)
    chunks = [parser.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [parser.finish()]
    assert parser.finish_reason("stop") == "tool_calls"
    deltas = [c.to_delta().model_dump() for c in chunks if c]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Weather tool."
    first = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
    assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
    assert first["function"]["name"] == "get_weather"
    # A plain message keeps OpenAI's shape: no reasoning_content / tool_calls keys.
    assert ParsedDelta(content="x").to_delta().model_dump() == {"content": "x"}


def request(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra)


def test_plans():
    assert plan_tools(request(), "hermes").mode == "none"
    auto = plan_tools(request(tools=[WEATHER]), "hermes")
    assert (auto.mode, auto.parser, auto.structured_outputs) == ("auto", "hermes", None)
    required = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required",
                                  parallel_tool_calls=False), None)
    schema = json.loads(required.structured_outputs.spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = plan_tools(request(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None)
    assert json.loads(named.structured_outputs.spec) == WEATHER["function"]["parameters"]
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), None).make_stream() is None


@pytest.mark.parametrize("extra", [
    {"tool_choice": "required"},
    {"tools": [WEATHER]},  # auto, but no parser for this model
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"tools": [WEATHER, WEATHER], "tool_choice": "required"},
])
def test_plan_errors(extra):
    with pytest.raises(APIError) as info:
        plan_tools(request(**extra), None)
    assert info.value.status_code == 400 and info.value.param in ("tool_choice", "tools")
