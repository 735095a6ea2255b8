"""LoRA adapters through the server (issue 44, item 4): --enable-lora --lora-modules,
`model` picks the adapter, /v1/models lists it with its parent, vLLM's runtime
load/unload routes, and bad adapters as 400s / 404s in OpenAI's error shape."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.support.lora_fixtures import build_adapter, peft_greedy_reference
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerThread

PROMPT = list(range(40, 90))
NUM_NEW = 8


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_api")
    base = build_tiny_checkpoint(root / "base", "llama")
    adapters = {name: build_adapter(base, root, name, seed=i)
                for i, name in enumerate(["a4", "b8", "c16"])}
    return base, adapters


@pytest.fixture(scope="module")
def server(case):
    from server.http.api_server import APIServer, ServeOptions
    from server.http.cli import engine_config_from_args, make_arg_parser

    base, adapters = case
    args = make_arg_parser().parse_args(
        ["--model", str(base), "--dtype", "float32", "--max-model-len", "256", "--port", "0",
         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
         "--lora-modules", f"a4={adapters['a4']} b8={adapters['b8']}",
         "--allow-runtime-lora-updating", "--log-level", "warning"])
    options = ServeOptions.from_options(vars(args), engine_mode="thread")
    thread = ServerThread(APIServer(options, engine_config_from_args(args, args.model, "tiny"),
                                    args.model, ["tiny"])).start()
    yield thread
    thread.stop()


def completion_text(server, model: str) -> str:
    body = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": NUM_NEW, "temperature": 0,
        "ignore_eos": True}).json()
    assert "choices" in body, body
    return body["choices"][0]["text"]


def test_model_picks_the_adapter_and_matches_peft(server, case):
    from transformers import AutoTokenizer

    base, adapters = case
    tokenizer = AutoTokenizer.from_pretrained(base)
    texts = {}
    for name in ("a4", "b8", None):
        ref = peft_greedy_reference(base, adapters.get(name), [PROMPT], NUM_NEW)
        texts[name] = completion_text(server, name or "tiny")
        assert texts[name] == tokenizer.decode(ref.token_ids[0]), name
    assert len(set(texts.values())) == 3  # each adapter answers differently


def test_models_lists_adapters_with_their_parent(server, case):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    cards = {m.id: m for m in client.models.list().data}
    assert {"tiny", "a4", "b8"} <= set(cards)
    assert cards["a4"].parent == "tiny" and cards["a4"].root == str(case[1]["a4"])


def test_responses_carry_the_adapters_name_on_every_api(server):
    """As vLLM answers: a response to a request for an adapter names the adapter."""
    import anthropic

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    hi = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="b8", max_tokens=4, messages=hi)
    assert chat.model == "b8" and chat.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="b8", max_tokens=4, messages=hi,
                                                 stream=True))
    assert chunks and {c.model for c in chunks} == {"b8"}
    assert client.completions.create(model="a4", prompt="hi", max_tokens=2).model == "a4"
    assert {c.model for c in client.completions.create(
        model="a4", prompt="hi", max_tokens=2, stream=True)} == {"a4"}
    assert client.responses.create(model="b8", input="hi", max_output_tokens=4).model == "b8"
    message = anthropic.Anthropic(base_url=server.url, api_key="x").messages.create(
        model="a4", max_tokens=4, messages=hi)
    assert message.model == "a4"
    assert client.chat.completions.create(model="tiny", max_tokens=2,
                                          messages=hi).model == "tiny"


def test_metrics_count_requests_per_adapter(server):
    from tests.support.metrics import parse

    def scrape() -> dict:
        return parse(httpx.get(server.url + "/metrics").text)[0]

    key = (("lora_name", "b8"), ("model_name", "tiny"))
    before = scrape().get(("pagedserve:lora_adapter_requests_total", key), 0)
    completion_text(server, "b8")
    samples = scrape()
    assert samples[("pagedserve:lora_adapter_requests_total", key)] == before + 1
    assert samples[("pagedserve:lora_adapter_generation_tokens_total", key)] >= NUM_NEW
    info = [dict(ls) for (n, ls) in samples if n == "vllm:lora_requests_info"]
    assert len(info) == 1 and info[0]["max_lora"] == "2"


def test_an_unknown_model_is_a_404(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


def test_runtime_load_and_unload(server, case):
    _, adapters = case
    url = server.url
    fresh = adapters["a4"]
    loaded = httpx.post(url + "/v1/load_lora_adapter",
                        json={"lora_name": "late", "lora_path": str(fresh)})
    assert loaded.status_code == 200, loaded.text
    assert completion_text(server, "late") == completion_text(server, "a4")
    assert httpx.post(url + "/v1/unload_lora_adapter",
                      json={"lora_name": "late"}).status_code == 200
    gone = httpx.post(url + "/v1/completions", json={"model": "late", "prompt": "hi",
                                                     "max_tokens": 2})
    assert gone.status_code == 404
    again = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"


def test_load_and_unload_while_requests_run(server, case):
    """Loading an adapter while requests stream loses none of them; unloading an adapter
    in use lets its running requests finish and refuses only new ones (404)."""
    _, adapters = case
    url = server.url
    assert httpx.post(url + "/v1/load_lora_adapter", json={
        "lora_name": "busy", "lora_path": str(adapters["a4"])}).status_code == 200
    streaming = threading.Barrier(5)  # four streams and this test, once each has a token
    results: dict[str, tuple[int, int, str | None]] = {}

    def stream(key: str, model: str) -> None:
        status, tokens, finish, first = 0, 0, None, True
        with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                "model": model, "prompt": PROMPT, "max_tokens": 150, "temperature": 0,
                "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    finish = chunk["choices"][0]["finish_reason"] or finish
                    if first:
                        first = False
                        streaming.wait(timeout=60)
        results[key] = (status, tokens, finish)

    threads = [threading.Thread(target=stream, args=(key, model)) for key, model in
               (("busy-1", "busy"), ("busy-2", "busy"), ("base", "tiny"), ("b8", "b8"))]
    for thread in threads:
        thread.start()
    streaming.wait(timeout=60)
    loaded = httpx.post(url + "/v1/load_lora_adapter", json={
        "lora_name": "late", "lora_path": str(adapters["a4"])})
    unloaded = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "busy"})
    assert loaded.status_code == 200 and unloaded.status_code == 200
    assert any(thread.is_alive() for thread in threads[:2]), "busy's requests ended too soon"
    refused = httpx.post(url + "/v1/completions", json={"model": "busy", "prompt": "hi",
                                                        "max_tokens": 2})
    assert refused.status_code == 404
    for thread in threads:
        thread.join(timeout=120)
    assert results == {key: (200, 150, "length") for key in ("busy-1", "busy-2", "base", "b8")}
    assert completion_text(server, "late") == completion_text(server, "a4")
    httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"})


@pytest.mark.parametrize("path_of,message", [
    (lambda a: "/nonexistent/adapter", "no adapter_config.json"),
    (lambda a: str(a["c16"]), "rank 16 is over --max-lora-rank 8"),
])
def test_bad_adapters_are_400s(server, case, path_of, message):
    response = httpx.post(server.url + "/v1/load_lora_adapter",
                          json={"lora_name": "bad", "lora_path": path_of(case[1])})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "lora_path"
    assert httpx.post(server.url + "/v1/load_lora_adapter", json={
        "lora_name": "a4", "lora_path": str(case[1]["a4"])}).status_code == 400  # name taken


def test_a_failed_replace_keeps_the_adapter_it_would_replace(server, case):
    url, paths = server.url, case[1]
    assert httpx.post(url + "/v1/load_lora_adapter", json={
        "lora_name": "swap", "lora_path": str(paths["a4"])}).status_code == 200
    failed = httpx.post(url + "/v1/load_lora_adapter", json={
        "lora_name": "swap", "lora_path": str(paths["c16"]), "load_inplace": True})
    assert failed.status_code == 400  # rank 16 is over the limit
    assert completion_text(server, "swap") == completion_text(server, "a4")
    replaced = httpx.post(url + "/v1/load_lora_adapter", json={
        "lora_name": "swap", "lora_path": str(paths["b8"]), "load_inplace": True})
    assert replaced.status_code == 200, replaced.text
    assert completion_text(server, "swap") == completion_text(server, "b8")
    assert httpx.post(url + "/v1/unload_lora_adapter",
                      json={"lora_name": "swap"}).status_code == 200
