"""sentence-transformers' named prompts (config_sentence_transformers.json): `prompt_name`
on /v1/embeddings puts the named prompt before each text, none given applies the model's
default_prompt_name, as sentence-transformers' encode does; an unknown name is a 400 naming
the model's prompts; token-id inputs get no prompt; Ollama's /api/embed applies the default."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from tests.support.minilm import unpack_minilm
from tests.support.server_fixtures import start_model_server

TEXTS = ["A man is eating food.", "Paged attention keeps the KV cache in blocks."]
NAME = "minilm-with-prompts"
PROMPTS = {"query": "query: ", "passage": "passage: "}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = unpack_minilm(tmp_path_factory.mktemp("minilm-prompts") / NAME)
    config_path = path / "config_sentence_transformers.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config.update(prompts=PROMPTS, default_prompt_name="passage")
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(model_dir), device="cpu")
    return {"query": model.encode(TEXTS, prompt_name="query", normalize_embeddings=True),
            "default": model.encode(TEXTS, normalize_embeddings=True),
            "none": model.encode(TEXTS, prompt="", normalize_embeddings=True)}


@pytest.fixture(scope="module")
def server(model_dir, reference):
    thread = start_model_server(model_dir, "--dtype", "float32", name=NAME)
    yield thread
    thread.stop()


def embed(server, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", timeout=60,
                      json={"model": NAME, "input": TEXTS, **fields})


def lowest_cosine(vectors, reference) -> float:
    vectors = np.asarray(vectors)
    return float(((vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1)).min())


def test_named_and_default_prompts_match_sentence_transformers(server, reference):
    # The prompts change the vectors, so the comparisons below can tell them apart.
    assert lowest_cosine(reference["query"], reference["default"]) < 0.999
    query = [d["embedding"] for d in embed(server, prompt_name="query").json()["data"]]
    assert lowest_cosine(query, reference["query"]) >= 0.9999
    default = [d["embedding"] for d in embed(server).json()["data"]]
    assert lowest_cosine(default, reference["default"]) >= 0.9999
    ollama = httpx.post(server.url + "/api/embed", timeout=60,
                        json={"model": NAME, "input": TEXTS}).json()["embeddings"]
    assert lowest_cosine(ollama, reference["default"]) >= 0.9999


def test_unknown_prompt_is_a_400_and_token_ids_get_no_prompt(server, reference):
    bad = embed(server, prompt_name="title")
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "prompt_name" and "passage, query" in error["message"]
    ids = server.server.state.tokenizer(TEXTS[0]).input_ids
    response = httpx.post(server.url + "/v1/embeddings", timeout=60, json={
        "model": NAME, "input": ids, "prompt_name": "query"}).json()
    assert response["usage"]["prompt_tokens"] == len(ids)
    assert lowest_cosine([response["data"][0]["embedding"]], reference["none"][:1]) >= 0.9999


def test_a_prompt_the_pooling_leaves_out(tmp_path):
    """include_prompt false (INSTRUCTOR-style Pooling): mean pooling skips the prompt's
    tokens, as sentence-transformers masks them; the vectors differ from pooling them."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    path = unpack_minilm(tmp_path / "excluded")
    config = json.loads((path / "1_Pooling" / "config.json").read_text())
    (path / "1_Pooling" / "config.json").write_text(json.dumps({**config,
                                                                "include_prompt": False}))
    (path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": PROMPTS, "default_prompt_name": None}))
    model = sentence_transformers.SentenceTransformer(str(path), device="cpu")
    expected = model.encode(TEXTS, prompt_name="query", normalize_embeddings=True)
    thread = start_model_server(path, "--dtype", "float32", name=NAME)
    try:
        got = embed(thread, prompt_name="query").json()["data"]
        assert lowest_cosine([d["embedding"] for d in got], expected) >= 0.9999
        pooled = model.encode([PROMPTS["query"] + t for t in TEXTS], prompt="",
                              normalize_embeddings=True)
        assert lowest_cosine(pooled, expected) < 0.999  # the test can tell the two apart
    finally:
        thread.stop()
