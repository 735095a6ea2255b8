"""Tool calls (auto, hermes), reasoning (qwen3) and chat_template_kwargs through the
whole server, over the echo FakeExecutor: its greedy output repeats the prompt, and
the chat template here renders only what a test asks for, so the "model" writes
exactly the text a test chose: think blocks and <tool_call> blocks included.
"""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from tests.support.server_fixtures import ServerThread, build_fake_server, build_tokenizer_dir

# The prompt is the last message's content, after an optional `prefix` template variable,
# then EOS (so the echo ends there, "stop"); earlier turns render their tool calls'
# arguments and tool results (to show they reach the template).
TEMPLATE = (
    "{% for m in messages[:-1] %}{% for c in m.tool_calls or [] %}"
    "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.role == 'tool' %}[{{ m.tool_call_id }}:{{ m.content }}]{% endif %}{% endfor %}"
    "{{ prefix | default('') }}{{ messages[-1]['content'] }}<|im_end|>"
)
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}}}}
ANSWER = ('<think>Need a lookup.</think>\n\nChecking. <tool_call>\n{"name": "lookup", '
          '"arguments": {"q": "tides"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(path))
    api_server = build_fake_server(path, max_model_len=512)
    api_server.options.tool_call_parser = "hermes"
    api_server.options.reasoning_parser = "qwen3"
    thread = ServerThread(api_server).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                       timeout=30) as c:
        yield c


def echo(content: str, **extra):
    """Chat kwargs whose greedy answer is the rendered prompt, up to its EOS."""
    messages = extra.pop("messages", [{"role": "user", "content": content}])
    return dict(model="fake-echo", messages=messages, temperature=0, max_tokens=300, **extra)


def test_auto_tool_call_with_reasoning_streamed_and_not(client, server):
    kwargs = echo(ANSWER, tools=[TOOL])
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.content == "Checking. "
    assert message.model_extra["reasoning_content"] == "Need a lookup."
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"q": "tides"})
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking. "
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
        "Need a lookup."
    streamed = [t for d in deltas for t in d.tool_calls or []]
    assert streamed[0].id.startswith("call_") and streamed[0].index == 0
    assert streamed[0].function.name == "lookup"
    assert "".join(t.function.arguments or "" for t in streamed) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_no_tool_call_is_plain_content(client, server):
    choice = client.chat.completions.create(
        **echo("Just text, 1 < 2 <tool", tools=[TOOL])).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "Just text, 1 < 2 <tool"


def test_parallel_tool_calls_false_keeps_the_first(client, server):
    two = ('<tool_call>{"name": "lookup", "arguments": {"q": "a"}}</tool_call>'
           '<tool_call>{"name": "lookup", "arguments": {"q": "b"}}</tool_call>')
    message = client.chat.completions.create(
        **echo(two, tools=[TOOL], parallel_tool_calls=False)).choices[0].message
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"q": "a"}]


def test_chat_template_kwargs_reach_the_template(client, server):
    kwargs = echo("Bonjour.",
                  extra_body={"chat_template_kwargs": {"prefix": "<think>hidden</think>"}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == ("Bonjour.", "hidden")


def test_tool_history_reaches_the_template(client, server):
    history = [
        {"role": "user", "content": "tides?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"q": "tides"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "high at 6"},
        {"role": "user", "content": "!"},
    ]
    kwargs = echo("", messages=history, tools=[TOOL], tool_choice="none")
    content = client.chat.completions.create(**kwargs).choices[0].message.content
    assert content == 'lookup{"q": "tides"}[call_1:high at 6]!'
