"""A cross-encoder reranker served (a tiny random BertForSequenceClassification with
all-MiniLM-L6-v2's tokenizer): /v1/rerank, /v2/rerank and /v1/score give transformers'
and sentence-transformers' CrossEncoder scores of each (query, document) pair, read
together with the document's tokens as type 1; it serves no embeddings."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import pytest
import torch

from tests.support.minilm import unpack_minilm
from tests.support.server_fixtures import start_model_server

QUERY = "How do paged KV caches save memory?"
DOCUMENTS = ["Blocks are allocated on demand, so no memory is reserved for unused context.",
             "The weather in Paris is mild in spring.",
             "Prefix caching shares the blocks of a common prompt between requests."]
NAME = "tiny-reranker"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification

    minilm = unpack_minilm(tmp_path_factory.mktemp("minilm"))
    path = tmp_path_factory.mktemp("reranker")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=1,
                        max_position_embeddings=128)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():  # spread the scores, and make the segments matter
        model.bert.embeddings.token_type_embeddings.weight.normal_(0, 1.0)
        model.classifier.weight.normal_(0, 1.0)
        model.bert.pooler.dense.weight.normal_(0, 0.3)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm / name, path / name)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        batch = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True,
                          return_tensors="pt")
        scores = torch.sigmoid(model(**batch).logits[:, 0]).numpy()
        # Read as one segment, the pairs score differently: the test sees token types.
        one_segment = {**batch, "token_type_ids": torch.zeros_like(batch["token_type_ids"])}
        flat = torch.sigmoid(model(**one_segment).logits[:, 0]).numpy()
    assert np.abs(scores - flat).max() > 1e-3 and np.ptp(scores) > 1e-3, (scores, flat)
    return scores


@pytest.fixture(scope="module")
def server(model_dir, reference):
    thread = start_model_server(model_dir, "--dtype", "float32", name=NAME)
    yield thread
    assert thread.server.state.engine.num_unfinished_requests == 0
    thread.stop()


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": NAME, **body}, timeout=60)


def test_rerank_and_score_match_transformers(server, reference):
    for path in ("/v1/rerank", "/v2/rerank"):
        ranked = post(server, path, query=QUERY, documents=DOCUMENTS).json()
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-reference))
        by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
        np.testing.assert_allclose([by_index[i] for i in range(3)], reference, atol=1e-5)
    scored = post(server, "/v1/score", text_1=QUERY, text_2=DOCUMENTS).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], reference, atol=1e-5)


def test_sentence_transformers_cross_encoder_agrees(server, model_dir, reference):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    encoder = sentence_transformers.CrossEncoder(str(model_dir), device="cpu")
    theirs = encoder.predict([(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose(theirs, reference, atol=1e-5)


def test_a_cross_encoder_serves_no_embeddings(server):
    response = post(server, "/v1/embeddings", input="hi")
    assert response.status_code == 400
    assert "cross-encoder" in response.json()["error"]["message"]
    empty = post(server, "/v1/rerank", query=QUERY, documents=[""])
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"
    too_many = post(server, "/v1/rerank", query=QUERY, documents=["x"] * 2049)
    assert too_many.status_code == 400 and "at most 2048" in too_many.json()["error"]["message"]
