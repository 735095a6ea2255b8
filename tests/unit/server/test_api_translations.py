"""The request translations of the Responses, Anthropic and Ollama layers onto a chat
request (no server): what each field becomes."""

from __future__ import annotations

import pytest

from server.apis.anthropic.protocol import MessagesRequest
from server.apis.anthropic.translator import _chat_fields as anthropic_fields
from server.apis.anthropic.translator import _stop
from server.apis.ollama.protocol import OllamaChatRequest
from server.apis.ollama.translator import _chat_messages
from server.apis.responses.protocol import ResponsesRequest
from server.apis.responses.translator import _input_messages
from server.chat.sampling import new_request_id
from server.common.api_label import GENERATION_APIS, REQUEST_ID_PREFIXES, api_of_request_id
from server.common.errors import APIError

TOOL = {"name": "f", "input_schema": {"type": "object"}}


def anthropic(**fields) -> dict:
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        **fields})
    return anthropic_fields(body)


def test_anthropic_tool_choices():
    assert anthropic(tools=[TOOL])["tool_choice"] == "auto"
    assert anthropic(tools=[TOOL], tool_choice={"type": "any"})["tool_choice"] == "required"
    assert anthropic(tools=[TOOL], tool_choice={"type": "none"})["tool_choice"] == "none"
    named = anthropic(tools=[TOOL], tool_choice={"type": "tool", "name": "f",
                                                  "disable_parallel_tool_use": True})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert named["parallel_tool_calls"] is False
    assert named["tools"] == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]  # no description: left out
    with pytest.raises(APIError) as info:
        anthropic(tools=[{**TOOL, "type": "web_search_20250305"}])
    assert info.value.param == "tools[0].type"


def test_anthropic_blocks_become_chat_turns():
    fields = anthropic(system=[{"type": "text", "text": "s1"}, {"type": "text", "text": "s2"}],
                       thinking={"type": "disabled"}, messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "x"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1",
             "content": [{"type": "text", "text": "r"}]},
            {"type": "text", "text": "next"}]}])
    assert fields["messages"] == [
        {"role": "system", "content": "s1\ns2"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "r"},
        {"role": "user", "content": "next"}]
    assert fields["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(APIError):  # a tool_result in an assistant turn
        anthropic(messages=[{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}])


def test_anthropic_stop_reasons():
    assert _stop("stop", None) == ("end_turn", None)
    assert _stop("stop", 2) == ("end_turn", None)  # an end-of-sequence token id
    assert _stop("stop", "END") == ("stop_sequence", "END")
    assert _stop("length", None) == ("max_tokens", None)
    assert _stop("tool_calls", None) == ("tool_use", None)


def test_responses_items_become_chat_turns():
    body = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "d"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}]})
    assert _input_messages(body.input) == [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "let me", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g",
                                                          "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]
    # An input_image becomes a chat image_url part, in order with the text.
    assert _input_messages(ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "what?"},
                                     {"type": "input_image", "image_url": "data:x"}]}]}).input
    ) == [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                       {"type": "image_url", "image_url": {"url": "data:x"}}]}]
    with pytest.raises(APIError) as info:  # file ids are not served
        _input_messages(ResponsesRequest.model_validate({"input": [
            {"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}).input)
    assert info.value.param == "input[0].content[0]"


def test_ollama_tool_calls_get_ids_their_results_answer():
    body = OllamaChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": {"a": 1}}},
            {"function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "content": "r1", "tool_name": "f"},
        {"role": "tool", "content": "r2", "tool_name": "g"}]})
    messages = _chat_messages(body)
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["call_0", "call_1"]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert [(m["tool_call_id"], m["name"]) for m in messages[2:]] == [
        ("call_0", "f"), ("call_1", "g")]


def test_request_ids_name_their_api():
    """Every prefix the routes give new_request_id maps to its route's API label."""
    assert set(REQUEST_ID_PREFIXES.values()) == set(GENERATION_APIS.values())
    for prefix, api in REQUEST_ID_PREFIXES.items():
        assert api_of_request_id(new_request_id(prefix.removesuffix("-"))) == api
    assert api_of_request_id("cmpl-3f2a-1") == "openai_completions"  # n > 1: one id each
    assert api_of_request_id("0") is None and api_of_request_id("ollama-3f2a") is None
