"""The embedding endpoints on a real server: OpenAI's /v1/embeddings through the official
client (float and base64), Ollama's /api/embed and /api/embeddings, their errors, and a
chat model's and an embedding model's refusals of each other's requests.

The model is a tiny random Llama served with --runner pooling (a decoder embedder: its
last token's hidden state, normalized); its vectors are checked against transformers'."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.support.hf_reference import load_hf_model
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import (
    build_tokenizer_dir,
    start_fake_server,
    start_model_server,
)

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama",
                                 max_position_embeddings=256)


@pytest.fixture(scope="module")
def server(model_dir):
    thread = start_model_server(model_dir, "--dtype", "float32", "--max-model-len",
                                str(MAX_MODEL_LEN), "--runner", "pooling")
    yield thread
    assert thread.server.state.engine.num_unfinished_requests == 0
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def reference(model_dir, token_ids: list[int]) -> np.ndarray:
    model = load_hf_model(model_dir)
    with torch.inference_mode():
        hidden = model(torch.tensor([token_ids]), output_hidden_states=True).hidden_states[-1]
    vector = hidden[0, -1].float()
    return (vector / vector.norm()).numpy()


def test_openai_client_float_and_base64_agree_with_transformers(server, client, model_dir):
    texts = ["a small cat", "two dogs ran across the road", "x"]
    floats = client.embeddings.create(model="tiny", input=texts, encoding_format="float")
    # The SDK asks for base64 by default and decodes it itself.
    decoded = client.embeddings.create(model="tiny", input=texts)
    tokenizer = server.server.state.tokenizer
    ids = [tokenizer(text).input_ids for text in texts]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert [d.index for d in floats.data] == [0, 1, 2]
    for item, other, token_ids in zip(floats.data, decoded.data, ids, strict=True):
        assert item.embedding == other.embedding  # base64 round trip: exact float32
        np.testing.assert_allclose(item.embedding, reference(model_dir, token_ids),
                                   atol=2e-5, rtol=1e-4)
    by_ids = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    # Alone or in a batch: the same vector up to float32 rounding (gemm blocking follows the
    # batch's shape).
    np.testing.assert_allclose(by_ids.data[0].embedding, floats.data[1].embedding, atol=1e-6)


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**6]}, "input"),
    ({"input": list(range(3, 3 + MAX_MODEL_LEN + 1))}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "dimensions": 8}, "dimensions"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": 3.5}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param):
    response = post(server, "/v1/embeddings", model="tiny", **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error["param"] or "") and error["message"]


def test_long_input_with_truncation_and_the_context_code(server):
    too_long = list(range(3, 3 + MAX_MODEL_LEN + 10))
    refused = post(server, "/v1/embeddings", model="tiny", input=too_long)
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    cut = post(server, "/v1/embeddings", model="tiny", input=too_long, truncate_prompt_tokens=-1,
               encoding_format="float").json()
    whole = post(server, "/v1/embeddings", model="tiny", input=too_long[:MAX_MODEL_LEN],
                 encoding_format="float").json()
    assert cut["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    np.testing.assert_allclose(cut["data"][0]["embedding"], whole["data"][0]["embedding"],
                               atol=1e-6)


def test_ollama_embed_and_embeddings(server):
    batch = post(server, "/api/embed", model="tiny:latest", input=["a cat", "a dog"]).json()
    assert len(batch["embeddings"]) == 2 and batch["prompt_eval_count"] > 0
    assert batch["total_duration"] > 0
    single = post(server, "/api/embeddings", model="tiny", prompt="a cat").json()
    np.testing.assert_allclose(single["embedding"], batch["embeddings"][0], atol=1e-6)
    assert np.linalg.norm(single["embedding"]) == pytest.approx(1.0, abs=1e-5)
    # Ollama's shape for errors; truncate false refuses what does not fit.
    long_text = " ".join(["word"] * 200)
    refused = post(server, "/api/embed", model="tiny", input=long_text, truncate=False)
    assert refused.status_code == 400 and "context length" in refused.json()["error"]
    assert post(server, "/api/embed", model="tiny", input=long_text).status_code == 200
    missing = post(server, "/api/embed", model="nope", input="x")
    assert missing.status_code == 404 and set(missing.json()) == {"error"}


def test_an_embedding_model_refuses_to_generate(server):
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})]:
        response = post(server, path, model="tiny", max_tokens=2, **body)
        assert response.status_code == 400
        assert "embedding model" in response.json()["error"]["message"]


def test_metrics_count_embeddings(server):
    post(server, "/v1/embeddings", model="tiny", input=["one", "two"])
    text = httpx.get(server.url + "/metrics").text
    counts = [line for line in text.splitlines()
              if line.startswith("pagedserve:embedding_inputs_total{")]
    assert counts and float(counts[0].rsplit(" ", 1)[1]) >= 2
    assert "pagedserve:embedding_request_seconds_bucket" in text


def test_a_chat_model_refuses_embeddings(tmp_path):
    thread = start_fake_server(build_tokenizer_dir(tmp_path))
    try:
        response = httpx.post(thread.url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "model_not_supported"
        assert "does not serve embeddings" in response.json()["error"]["message"]
        ollama = httpx.post(thread.url + "/api/embed", timeout=30,
                            json={"model": "fake-echo", "input": "hi"})
        assert ollama.status_code == 400 and set(ollama.json()) == {"error"}
    finally:
        thread.stop()
