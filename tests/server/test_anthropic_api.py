"""Anthropic Messages (POST /v1/messages, /v1/messages/count_tokens) through the official
`anthropic` SDK and LangChain's ChatAnthropic, over the echo model: its greedy answer is
the last message's text (tests/support/server_fixtures.py, ECHO_CHAT_TEMPLATE), so
thinking blocks, tool calls and stop sequences come out exactly as a test wrote them.
"""

from __future__ import annotations

import logging

import anthropic
import httpx
import pytest

from tests.support.reliability_fixtures import metric
from tests.support.server_fixtures import FAIL_TEXT

MODEL = "fake-echo"
TOOL = {"name": "lookup", "description": "Look something up.",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "tides"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(echo_chat_server):
    yield echo_chat_server
    assert echo_chat_server.server.state.engine.num_unfinished_requests == 0


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                             timeout=30) as c:
        yield c


# The SDK has no sampling arguments any more; the API still takes them.
GREEDY = {"extra_body": {"temperature": 0}}


def ask(text: str, **extra):
    return dict(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": text}],
                **GREEDY, **extra)


def test_create_and_stream_agree(client, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.access")
    kwargs = ask("Hello there, world!", system="Be brief.")
    message = client.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg-")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "[sys:Be brief.]Hello there, world!"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens > 0
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        client.messages.count_tokens(**{k: v for k, v in kwargs.items()
                                        if k not in ("max_tokens", "extra_body")}).input_tokens
    with client.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == message.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == message.usage.output_tokens
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop",
            "message_delta"} <= set(events)
    logged = [r.getMessage() for r in caplog.records if "POST /v1/messages " in r.getMessage()]
    assert logged and all(" api=anthropic_messages " in line for line in logged), logged


def test_stop_reasons(client):
    message = client.messages.create(**ask("alpha beta gamma", stop_sequences=["gam"]))
    assert (message.content[0].text, message.stop_reason, message.stop_sequence) == \
        ("alpha beta ", "stop_sequence", "gam")
    message = client.messages.create(**{**ask("alpha beta gamma delta"), "max_tokens": 2})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 2


def test_thinking_and_tool_use_round_trip(client):
    kwargs = ask("<think>Need a lookup.</think>\n\nChecking. " + CALL, tools=[TOOL])
    message = client.messages.create(**kwargs)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = message.content
    assert (thinking.thinking, text.text) == ("Need a lookup.", "Checking. ")
    assert (call.name, call.input) == ("lookup", {"q": "tides"})
    assert call.id.startswith("toolu_") and message.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"q": "tides"} and final.stop_reason == "tool_use"
    # The tool result goes back; the echo shows the call and the result reached the prompt.
    reply = client.messages.create(model=MODEL, max_tokens=200, tools=[TOOL], **GREEDY,
                                   messages=[
        kwargs["messages"][0],
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "high at 6"},
            {"type": "text", "text": "thanks"}]},
    ])
    assert reply.content[0].text == f'lookup{{"q": "tides"}}[{call.id}:high at 6]thanks'
    assert reply.stop_reason == "end_turn"


def test_errors_have_anthropic_shape(client, server):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(**{**ask("hi"), "model": "no-such-model"})
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "not_found_error"
    response = httpx.post(server.url + "/v1/messages", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400
    assert response.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "Missing required parameter: 'max_tokens'."}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=5, **GREEDY, messages=[
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "AAAA"}}]}])
    assert "image" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(**{**ask("hi"), "max_tokens": 0})
    state = server.server.state
    state.api_key = "secret"
    try:
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(**ask("hi"))
        assert info.value.body["error"]["type"] == "authentication_error"
        with anthropic.Anthropic(base_url=server.url, api_key="secret", max_retries=0) as keyed:
            assert keyed.messages.create(**ask("hi")).content[0].text == "hi"
    finally:
        state.api_key = None
    assert client.messages.create(**ask("still serving")).content[0].text == "still serving"
    metrics = httpx.get(server.url + "/metrics").text
    for status in ("2xx", "4xx"):
        assert metric(metrics, "pagedserve:api_requests_total", api="anthropic_messages",
                      status=status) > 0


def test_engine_failure(client):
    """Not streamed: a 500 in Anthropic's shape; streamed: an `error` event after
    message_start."""
    with pytest.raises(anthropic.InternalServerError) as info:
        client.messages.create(**ask("boom " + FAIL_TEXT))
    assert info.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as info, \
            client.messages.stream(**ask("boom " + FAIL_TEXT)) as stream:
        for _ in stream:
            pass
    assert "fail" in str(info.value)
    assert client.messages.create(**ask("fine")).content[0].text == "fine"


def test_langchain_chat_anthropic_tools(server):
    from langchain_anthropic import ChatAnthropic

    chat = ChatAnthropic(model=MODEL, base_url=server.url, api_key="none", temperature=0,
                         max_tokens=200, max_retries=0)
    answer = chat.bind_tools([TOOL]).invoke("Sure. " + CALL)
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("lookup", {"q": "tides"})]
    assert chat.invoke("plain words").content == "plain words"
