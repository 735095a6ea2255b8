"""The Ollama API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version)
through the official `ollama` client and LangChain's ChatOllama, over the echo model:
its greedy answer is the last message's text (tests/support/server_fixtures.py,
ECHO_CHAT_TEMPLATE), so tool calls and thinking come out exactly as a test wrote them.
"""

from __future__ import annotations

import json

import httpx
import ollama
import pytest

from tests.support.server_fixtures import FAIL_TEXT

MODEL = "fake-echo"
GREEDY = {"temperature": 0}
TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "tides"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(echo_chat_server):
    yield echo_chat_server
    assert echo_chat_server.server.state.engine.num_unfinished_requests == 0


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=30)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_stream_equals_whole(client):
    messages = [{"role": "system", "content": "terse"}] + user("Hello there, world!")
    answer = client.chat(model=MODEL, messages=messages, options=GREEDY)
    assert answer.message.role == "assistant"
    assert answer.message.content == "[sys:terse]Hello there, world!"
    assert answer.done and answer.done_reason == "stop"
    assert answer.prompt_eval_count > 0 and answer.eval_count > 0
    assert answer.total_duration >= answer.eval_duration > 0
    parts = list(client.chat(model=MODEL + ":latest", messages=messages, options=GREEDY,
                             stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == answer.message.content
    assert parts[-1].eval_count == answer.eval_count
    short = client.chat(model=MODEL, messages=user("one two three four five"),
                        options={**GREEDY, "num_predict": 2})
    assert short.done_reason == "length" and short.eval_count == 2


def test_generate_stream_context_and_raw(client):
    answer = client.generate(model=MODEL, prompt="alpha beta", system="sys", options=GREEDY)
    assert answer.response == "[sys:sys]alpha beta" and answer.done_reason == "stop"
    pieces = list(client.generate(model=MODEL, prompt="alpha beta", system="sys",
                                  options=GREEDY, stream=True))
    assert "".join(p.response for p in pieces) == answer.response
    assert pieces[-1].context == answer.context
    assert len(answer.context) == answer.prompt_eval_count + answer.eval_count
    raw = client.generate(model=MODEL, prompt="gamma delta", raw=True,
                          options={**GREEDY, "num_predict": 4})
    assert raw.eval_count == 4 and raw.response and "gamma delta".startswith(raw.response)
    stopped = client.generate(model=MODEL, prompt="alpha beta gamma", options={
        **GREEDY, "stop": ["gam"]})
    assert stopped.response == "alpha beta "
    loaded = client.generate(model=MODEL, prompt="")
    assert loaded.done_reason == "load" and loaded.response == ""


def test_format_goes_through_structured_outputs(client, server):
    def json_object_requests() -> float:
        text = httpx.get(server.url + "/metrics").text
        line = next(line for line in text.splitlines() if line.startswith(
            "pagedserve:structured_output_requests_total") and 'kind="json_object"' in line)
        return float(line.rsplit(" ", 1)[1])

    before = json_object_requests()
    answer = client.chat(model=MODEL, messages=user('{"a": [1, 2]}'), format="json",
                         options=GREEDY)
    assert json.loads(answer.message.content) == {"a": [1, 2]}
    assert json_object_requests() == before + 1
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    answer = client.generate(model=MODEL, prompt='{"a": 3}', format=schema, options=GREEDY)
    assert json.loads(answer.response) == {"a": 3}


def test_tools_round_trip(client):
    messages = user("<think>Need it.</think>\n\nSure. " + CALL)
    answer = client.chat(model=MODEL, messages=messages, tools=[TOOL], options=GREEDY)
    assert answer.message.thinking == "Need it."
    assert answer.message.content == "Sure. "
    [call] = answer.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("lookup", {"q": "tides"})
    parts = list(client.chat(model=MODEL, messages=messages, tools=[TOOL], options=GREEDY,
                             stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [dict(c.function.arguments) for c in streamed] == [{"q": "tides"}]
    assert "".join(p.message.thinking or "" for p in parts) == "Need it."
    reply = client.chat(model=MODEL, tools=[TOOL], options=GREEDY, messages=[
        *messages, answer.message, {"role": "tool", "content": "high at 6",
                                    "tool_name": "lookup"}, *user("thanks")])
    assert reply.message.content == 'lookup{"q": "tides"}[call_0:high at 6]thanks'


def test_listings(client, server):
    [listed] = client.list().models
    # The echo model has a tokenizer and no weights (real files: tests/unit/server/
    # test_ollama_listings.py).
    assert listed.model == MODEL + ":latest" and listed.size == 0 and len(listed.digest) == 64
    shown = client.show(MODEL)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert shown.modelinfo[f"{shown.details.family}.context_length"] == 512
    assert "messages" in shown.template
    [running] = client.ps().models
    assert running.model == listed.model and running.context_length == 512
    assert httpx.get(server.url + "/api/version").json()["version"]


def test_errors_have_ollama_shape(client, server):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=user("hi"))
    assert info.value.status_code == 404 and "no-such-model" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.show("no-such-model")
    assert info.value.status_code == 404
    cases = [
        ("/api/chat", {"model": MODEL, "messages": user("hi"), "options": {"num_predict": 0}}),
        ("/api/chat", {"model": MODEL, "messages": user("hi"), "options": {"num_ctx": 10**6}}),
        ("/api/chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}),
        ("/api/generate", {"model": MODEL, "prompt": "hi", "suffix": "end"}),
        ("/api/generate", {"model": MODEL, "prompt": "hi", "format": "yaml"}),
        ("/api/generate", {"model": MODEL, "prompt": "hi " * 40, "options": {"num_ctx": 20}}),
    ]
    for path, body in cases:
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 400, (body, response.text)
        assert list(response.json()) == ["error"], response.text
    response = httpx.post(server.url + "/api/pull", json={"model": MODEL})
    assert response.status_code == 404 and list(response.json()) == ["error"]
    assert client.generate(model=MODEL, prompt="still", options=GREEDY).response == "still"


def test_engine_failure(client):
    """Not streamed: a 500 {"error"}; streamed: an {"error"} line the client raises."""
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=MODEL, messages=user("boom " + FAIL_TEXT), options=GREEDY)
    assert info.value.status_code == 500 and "fail" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        list(client.generate(model=MODEL, prompt="boom " + FAIL_TEXT, stream=True))
    assert "fail" in info.value.error
    assert client.generate(model=MODEL, prompt="fine", options=GREEDY).response == "fine"


def test_langchain_chat_ollama_tools(server):
    from langchain_ollama import ChatOllama

    chat = ChatOllama(model=MODEL, base_url=server.url, temperature=0)
    answer = chat.bind_tools([TOOL]).invoke("Sure. " + CALL)
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("lookup", {"q": "tides"})]
    assert chat.invoke("plain words").content == "plain words"


def test_a_body_without_a_json_content_type_is_read_as_json(server):
    """`curl -d '{...}'` (application/x-www-form-urlencoded), as Ollama's docs write it."""
    body = json.dumps({"model": MODEL, "stream": False, "messages": user("plain curl"),
                       "options": GREEDY})
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": content_type} if content_type else {}
        answer = httpx.post(server.url + "/api/chat", content=body, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["message"]["content"] == "plain curl"
    answer = httpx.post(server.url + "/api/chat", content="not json",
                        headers={"content-type": "application/x-www-form-urlencoded"})
    assert answer.status_code == 400 and "error" in answer.json()
