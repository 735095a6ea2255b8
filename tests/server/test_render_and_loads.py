"""vLLM's render endpoints and SGLang's load reports (issue 43: what routers call).

One server with the echo FakeExecutor (greedy output repeats the prompt; a slow step, so
streams stay running while the load is read), driven with httpx and the official client.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.support.server_fixtures import build_tokenizer_dir, start_fake_server

MODEL = "fake-echo"
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is a paged KV cache?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    thread = start_fake_server(build_tokenizer_dir(tmp_path_factory.mktemp("tok")),
                               max_model_len=MAX_MODEL_LEN, served_model_name=MODEL,
                               executor_kwargs={"step_delay_s": 0.02})
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def core_load(http) -> dict:
    response = http.get("/v1/loads", params={"include": "core,disagg,queues,memory"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1
    return body


def test_chat_render_gives_the_prompt_the_chat_would_run(server, http):
    before = core_load(http)["loads"][0]
    rendered = http.post("/v1/chat/completions/render", json={
        "model": MODEL, "messages": MESSAGES, "temperature": 0.5, "stop": ["\n"],
        "max_tokens": 7, "seed": 3, "priority": 0})
    assert rendered.status_code == 200, rendered.text
    body = rendered.json()
    tokenized = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert body["token_ids"] == tokenized["tokens"]
    params = body["sampling_params"]
    assert (params["temperature"], params["max_tokens"], params["stop"], params["seed"]) == \
        (0.5, 7, ["\n"], 3)
    assert body["model"] == MODEL and body["features"] is None
    assert body["request_id"].startswith("chatcmpl-")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                              temperature=0)
    assert chat.usage.prompt_tokens == len(body["token_ids"])
    # Without max_tokens the rest of the context, as the engine would resolve it.
    rest = http.post("/v1/chat/completions/render",
                     json={"model": MODEL, "messages": MESSAGES}).json()
    assert rest["sampling_params"]["max_tokens"] == MAX_MODEL_LEN - len(rest["token_ids"])
    # Rendering queued nothing: the only request that ran was the chat above.
    after = core_load(http)["loads"][0]
    assert after["num_total_reqs"] == before["num_total_reqs"] == 0


def test_completion_render_gives_one_request_per_prompt(server, http):
    tokenizer = server.server.state.tokenizer
    rendered = http.post("/v1/completions/render", json={
        "model": MODEL, "prompt": ["Hello world", "A longer second prompt"],
        "max_tokens": 4})
    assert rendered.status_code == 200, rendered.text
    items = rendered.json()
    assert [item["token_ids"] for item in items] == [
        list(tokenizer("Hello world").input_ids),
        list(tokenizer("A longer second prompt").input_ids)]
    assert len({item["request_id"] for item in items}) == 2
    ids = http.post("/v1/completions/render",
                    json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1}).json()
    assert ids[0]["token_ids"] == [5, 6, 7]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions/render", {"model": MODEL, "messages": MESSAGES, "bogus": 1}, "bogus"),
    ("/v1/chat/completions/render", {"model": MODEL, "messages": MESSAGES,
                                     "temperature": -1}, "temperature"),
    ("/v1/completions/render", {"model": MODEL, "prompt": [], "max_tokens": 1}, "prompt"),
    ("/v1/completions/render", {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN,
                                "max_tokens": 4}, None),
])
def test_render_refuses_what_the_endpoint_would(http, path, body, param):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert param in (error["param"] or "") or param in error["message"]


def test_unknown_model_is_a_404(http):
    response = http.post("/v1/chat/completions/render",
                         json={"model": "nope", "messages": MESSAGES})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


def test_loads_count_running_streams_and_return_to_zero(server, http):
    idle = core_load(http)
    load = idle["loads"][0]
    assert load["dp_rank"] == 0 and load["num_running_reqs"] == 0
    assert load["max_total_num_tokens"] > 0 and load["max_running_requests"] > 0
    assert load["queues"]["waiting"] == 0
    assert idle["aggregate"]["total_reqs"] == 0

    done = []

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "one two three", "max_tokens": 150,
                "ignore_eos": True, "stream": True}) as response:
            for _ in response.iter_lines():
                pass
        done.append(True)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while True:  # both streams running: the report sees them and their KV blocks
        busy = core_load(http)["loads"][0]
        if busy["num_running_reqs"] == 2 and busy["num_used_tokens"] > 0:
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)
    assert 0 < busy["token_usage"] <= 1
    legacy = http.get("/get_load").json()
    assert legacy[0]["dp_rank"] == 0 and legacy[0]["num_reqs"] >= 1
    for thread in threads:
        thread.join(60)
    assert len(done) == 2
    assert core_load(http)["loads"][0]["num_total_reqs"] == 0
    assert http.get("/get_load").json()[0]["num_reqs"] == 0


@pytest.mark.parametrize("params, name", [
    ({"include": "core,bogus"}, "include"), ({"dp_rank": 1}, "dp_rank"),
    ({"format": "prometheus"}, "format")])
def test_loads_refuse_what_they_do_not_serve(http, params, name):
    response = http.get("/v1/loads", params=params)
    assert response.status_code == 400 and response.json()["error"]["param"] == name
