"""The OpenAI Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}) through
the official `openai` SDK's client.responses (create, stream, parse) and LangChain's
ChatOpenAI on the Responses API, over the echo model: its greedy answer is the last
message's text (tests/support/server_fixtures.py, ECHO_CHAT_TEMPLATE), so reasoning,
tool calls and JSON come out exactly as a test wrote them.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from server.apis.responses.store import ResponseStore
from tests.support.server_fixtures import FAIL_TEXT

MODEL = "fake-echo"
TOOL = {"type": "function", "name": "lookup", "description": "Look something up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "tides"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(echo_chat_server):
    yield echo_chat_server
    assert echo_chat_server.server.state.engine.num_unfinished_requests == 0


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                       timeout=30) as c:
        yield c


def test_create_stream_and_store(client):
    kwargs = dict(model=MODEL, input="Hello there, world!", instructions="terse",
                  temperature=0)
    response = client.responses.create(**kwargs)
    assert response.object == "response" and response.status == "completed"
    assert response.id.startswith("resp_")
    assert response.output_text == "[sys:terse]Hello there, world!"
    [message] = response.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert response.usage.output_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + \
        response.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == response.output_text
    assert final.usage.output_tokens == response.usage.output_tokens
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    assert {"response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.output_item.done"} <= set(kinds)
    assert client.responses.retrieve(final.id).output_text == final.output_text
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_previous_response_id_and_the_store(client, server):
    first = client.responses.create(model=MODEL, input="one", temperature=0)
    second = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "two"}]}],
        previous_response_id=first.id, instructions="sys", temperature=0)
    # The echo template shows only system text and the last message: the stored
    # conversation comes first, the new instructions apply.
    assert second.output_text == "[sys:sys]two"
    assert second.previous_response_id == first.id
    assert len(server.server.state.responses.get(second.id).messages) == 4
    unstored = client.responses.create(model=MODEL, input="x", store=False, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    assert info.value.body["param"] == "previous_response_id"
    state = server.server.state
    kept, state.responses = state.responses, ResponseStore(max_size=3, ttl_s=3600)
    try:
        kept_id = client.responses.create(model=MODEL, input="kept", temperature=0).id
        for i in range(3):  # the store keeps 3: the oldest goes
            client.responses.create(model=MODEL, input=f"fill {i}", temperature=0)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept_id)
    finally:
        state.responses = kept


def test_reasoning_and_function_call_round_trip(client):
    kwargs = dict(model=MODEL, input="<think>Need it.</think>\n\n" + CALL, tools=[TOOL],
                  temperature=0)
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    reasoning, call = response.output
    assert reasoning.content[0].text == "Need it."
    assert (call.name, json.loads(call.arguments)) == ("lookup", {"q": "tides"})
    assert call.call_id.startswith("call_")
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[1].arguments == call.arguments
    reply = client.responses.create(model=MODEL, tools=[TOOL], temperature=0, input=[
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "high at 6"},
        {"role": "user", "content": "thanks"}])
    assert reply.output_text == f'lookup{{"q": "tides"}}[{call.call_id}:high at 6]thanks'


class Answer(BaseModel):
    city: str
    days: int


def test_parse_with_a_text_format(client):
    parsed = client.responses.parse(model=MODEL, input='{"city": "Oslo", "days": 3}',
                                    text_format=Answer, temperature=0)
    assert parsed.output_parsed == Answer(city="Oslo", days=3)
    short = client.responses.create(model=MODEL, input="one two three four five",
                                    max_output_tokens=2, temperature=0)
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"


def test_errors_are_openai_shaped(client, server):
    for bad in (dict(input="hi", bogus=1), dict(input=[{"type": "input_image"}]),
                dict(input="hi", max_output_tokens=0), dict(input="hi", background=True),
                dict(input=[{"role": "user", "content": [{"type": "input_image",
                                                          "image_url": "x"}]}])):
        response = httpx.post(server.url + "/v1/responses", json={"model": MODEL, **bad})
        assert response.status_code == 400, (bad, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    assert client.responses.create(model=MODEL, input="ok", temperature=0).output_text == "ok"


def test_engine_failure(client):
    """Not streamed: a 500 error object; streamed: an `error` event (the last) after
    response.created."""
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=MODEL, input="boom " + FAIL_TEXT, temperature=0)
    with client.responses.stream(model=MODEL, input="boom " + FAIL_TEXT,
                                 temperature=0) as stream:
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "error"
    assert "fail" in events[-1].message and events[-1].code == "engine_error"
    assert client.responses.create(model=MODEL, input="fine", temperature=0).output_text == \
        "fine"


def test_langchain_chat_openai_on_responses(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none",
                      temperature=0, use_responses_api=True, max_retries=0)
    answer = chat.bind_tools([TOOL]).invoke("Sure. " + CALL)
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [("lookup", {"q": "tides"})]
    assert chat.invoke("plain words").text == "plain words"
