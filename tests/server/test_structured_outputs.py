"""Structured outputs with the real default model (SmolLM2-135M-Instruct) end to end.

A weak model still produces output that parses and validates: the grammar guarantees
it. One server for the module, with a KV cache small enough (16 blocks of 16 tokens)
that a few concurrent constrained requests preempt each other.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.support.server_fixtures import ServerProcess, serving

MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 8},
                    "maxItems": 2},
        "pet": {
            "type": "object",
            "properties": {"kind": {"enum": ["cat", "dog"]},
                           "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
            "required": ["kind", "legs"], "additionalProperties": False,
        },
    },
    "required": ["name", "age", "hobbies", "pet"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def server():
    from engine.model_loader.source import ModelSourceError, resolve_model

    try:
        resolve_model(None)
    except ModelSourceError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    # float32 on every CPU: the 12M KV cache then holds the same few blocks everywhere (a
    # bfloat16 cache on a native-bf16 CPU would hold twice as many, and nothing preempts).
    proc = ServerProcess(["--port", "0", "--max-model-len", "256", "--kv-cache-memory", "12M",
                          "--max-num-batched-tokens", "256", "--dtype", "float32"], env={})
    with serving(proc):
        yield proc


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(http, **body) -> dict:
    body = {"model": MODEL, "temperature": 0, "messages": ASK_PERSON, **body}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_text(http, path: str, body: dict) -> tuple[str, str]:
    """(joined text, finish_reason) of a streamed completion or chat completion."""
    pieces, finish = [], None
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(pieces), finish


def test_json_schema_validates_and_stream_equals_non_stream(http):
    body = {"max_tokens": 60, "response_format": PERSON_FORMAT}
    choice = chat(http, **body)["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    streamed, finish = stream_text(
        http, "/v1/chat/completions", {"model": MODEL, "temperature": 0,
                                       "messages": ASK_PERSON, **body})
    assert (streamed, finish) == (choice["message"]["content"], "stop")


def test_json_object(http):
    content = chat(http, max_tokens=30, response_format={"type": "json_object"},
                   messages=[{"role": "user", "content": "Reply with a JSON object."}])
    choice = content["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
     lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_regex": r"(yes|no), [a-z]{2,6}\."}, lambda t: re.fullmatch(r"(yes|no), [a-z]{2,6}\.", t)),
    ({"structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
     lambda t: t in ("Paris", "Lyon", "Nice")),
    ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
    ({"structured_outputs": {"grammar": 'root ::= "The answer is " [0-9] [0-9]? "."'}},
     lambda t: re.fullmatch(r"The answer is [0-9][0-9]?\.", t)),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"], "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_completions_kinds(http, extra, check):
    body = {"model": MODEL, "prompt": "Question: what is the capital of France?\nAnswer:",
            "temperature": 0, "max_tokens": 24, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice
    assert stream_text(http, "/v1/completions", body) == (choice["text"], "stop")


def test_n2_sampled_mixed_with_free_requests_and_preemption(http, client):
    """n = 2 sampled constrained choices beside free greedy requests, in a KV cache too
    small for all of them: every constrained output validates, every free greedy
    output is the one it has alone, and the server did preempt."""
    free = dict(model=MODEL, temperature=0, max_tokens=20,
                messages=[{"role": "user", "content": "Tell me about the sea."}])
    alone = client.chat.completions.create(**free).choices[0].message.content
    preemptions_before = _metric(http, "pagedserve:num_preemptions_total")

    def constrained(seed: int) -> list[dict]:
        return chat(http, n=2, temperature=0.9, seed=seed, max_tokens=80,
                    response_format=PERSON_FORMAT)["choices"]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(constrained, seed) for seed in (1, 2)]
        frees = [pool.submit(client.chat.completions.create, **free) for _ in range(2)]
        for job in jobs:
            choices = job.result()
            assert len(choices) == 2
            for choice in choices:
                if choice["finish_reason"] == "stop":
                    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
                else:
                    assert choice["finish_reason"] == "length"
        assert [f.result().choices[0].message.content for f in frees] == [alone, alone]
    assert _metric(http, "pagedserve:num_preemptions_total") > preemptions_before
    assert _metric(http, "pagedserve:structured_output_requests_total", 'kind="json"') >= 2


def test_openai_sdk_parse(client):
    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=4)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=16)
        age: int = pydantic.Field(ge=0, le=120)
        pets: list[Pet] = pydantic.Field(max_length=2)

    completion = client.chat.completions.parse(
        model=MODEL, messages=ASK_PERSON, response_format=Person, temperature=0,
        max_tokens=100)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person)
    assert Person.model_validate_json(message.content) == message.parsed


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"type": "string", "maxLength": 8}}, "required": ["tz"],
        "additionalProperties": False}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def test_required_tool_calls_stream_reassembled_by_the_sdk(client):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, CLOCK],
                  tool_choice="required", temperature=0, max_tokens=60)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]


def test_named_tool_then_a_second_turn_with_the_result(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "stop"  # a forced function ends "stop", as OpenAI's
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    history = [*ASK_WEATHER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                            tool_choice="none", temperature=0, max_tokens=8)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


def test_langchain_structured_output_and_bind_tools(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class Pet(pydantic.BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = pydantic.Field(ge=0, le=4)

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL,
                     temperature=0, max_tokens=40, max_retries=0, timeout=120)
    pet = llm.with_structured_output(Pet).invoke("Describe a pet as JSON.")
    assert isinstance(pet, Pet)
    message = llm.bind_tools([get_weather], tool_choice="any").invoke(
        "What is the weather in Paris?")
    [call] = message.tool_calls[:1]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


BAD = [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}},
     "response_format.json_schema.schema", "'not'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
    ({"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "parenthesis"),
    ({"structured_outputs": {"regex": "a{100000}"}}, "structured_outputs.regex", "limit"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "not defined"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_json": {"type": "string", "maxLength": 100000}}, "guided_json", "limit"),
    ({"structured_outputs": {"unknown": 1}}, "structured_outputs.unknown", ""),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "Only one"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "structured"),
    ({"guided_regex": "a" * 70_000}, "guided_regex", "characters"),
]


@pytest.mark.parametrize("extra,param,fragment", BAD)
def test_bad_specs_are_400s(http, extra, param, fragment):
    for path, body in (("/v1/chat/completions", {"messages": ASK_PERSON}),
                       ("/v1/completions", {"prompt": "hi"})):
        response = http.post(path, json={"model": MODEL, "max_tokens": 2, **body, **extra})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param and fragment in error["message"], error


def test_still_serving_after_bad_specs(http):
    choice = chat(http, max_tokens=10, guided_choice=["yes", "no"])["choices"][0]
    assert choice["message"]["content"] in ("yes", "no")


def _metric(http, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# A prompt whose JSON answer can copy it: n-gram speculation has something to guess.
COPY_PERSON = [{"role": "user", "content": (
    'Reply with this JSON, unchanged: {"name": "Ada", "age": 36, "hobbies": ["chess", "golf"], '
    '"pet": {"kind": "cat", "legs": 4}}')}]


def answer(choice: dict) -> tuple:
    """A chat choice's content, calls (name, arguments; their ids are random) and finish."""
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in choice["message"].get("tool_calls") or []]
    return choice["message"]["content"], calls, choice["finish_reason"]


@pytest.fixture(scope="module")
def speculating_server():
    """The module's server flags plus n-gram speculation."""
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    proc = ServerProcess(["--port", "0", "--max-model-len", "256", "--kv-cache-memory", "12M",
                          "--max-num-batched-tokens", "256", "--dtype", "float32",
                          "--speculative-config", spec], env={})
    with serving(proc):
        yield proc


@pytest.mark.parametrize("extra", [
    {"response_format": PERSON_FORMAT},
    {"guided_regex": r'\{"name": "[A-Za-z]{1,8}", "age": [0-9]{1,3}\}'},
    {"tools": [WEATHER, CLOCK], "tool_choice": "required"},
    # Not a grammar, but the other per-position rules over HTTP (each guessed position
    # counts the guesses before it as output; that counting itself is checked where it can
    # fail: tests/unit/sample/test_verify_rows.py, tests/engine/test_spec_decode.py). Mild
    # values: a strong repetition penalty stops the model copying, and then nothing is
    # accepted.
    {"frequency_penalty": 0.2, "repetition_penalty": 1.05, "min_tokens": 20},
], ids=["json-schema", "regex", "tools-required", "penalties-min-tokens"])
def test_speculation_keeps_constrained_outputs(http, speculating_server, extra):
    """Over HTTP, a constrained (or penalised) greedy request gives the same answer,
    streamed or not, with n-gram speculation as without; the speculating server did guess
    (its drafts are checked against the grammar before they are verified)."""
    with httpx.Client(base_url=speculating_server.url, timeout=120) as spec_http:
        accepted_before = _metric(spec_http, "pagedserve:spec_decode_num_accepted_tokens_total")
        body = {"messages": COPY_PERSON, "max_tokens": 60, **extra}
        plain = chat(http, **body)["choices"][0]
        speculated = chat(spec_http, **body)["choices"][0]
        assert answer(speculated) == answer(plain)
        if "tools" not in extra:
            streamed = stream_text(spec_http, "/v1/chat/completions",
                                   {"model": MODEL, "temperature": 0, **body})
            assert streamed == (plain["message"]["content"], plain["finish_reason"])
        assert _metric(spec_http, "pagedserve:spec_decode_num_accepted_tokens_total") > \
            accepted_before
