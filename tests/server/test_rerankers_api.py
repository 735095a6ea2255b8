"""The rerankers beside BERT served over HTTP (httpx against the real server): a tiny
random XLM-RoBERTa cross-encoder (bge-reranker style), a Qwen3ForSequenceClassification
checkpoint, and a causal-LM Qwen3-Reranker under vLLM's --hf-overrides with its prompt
format. /v1/rerank, /v2/rerank and /v1/score give transformers' scores of each pair on
the same weights (within 1e-4, the same order), each pair read as the family reads it:
the tokenizer's pair template for the encoder, query + document for the decoders."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from tests.support.reranker_fixtures import (
    DOCUMENTS,
    QUERY,
    QWEN3_RERANKER_OVERRIDES,
    build_tiny_decoder_reranker,
    build_tiny_xlm_roberta,
    qwen3_reranker_pair,
)
from tests.support.server_fixtures import start_model_server

NAME = "tiny-reranker"


def serve(model_dir, *args: str):
    thread = start_model_server(model_dir, "--dtype", "float32", *args, name=NAME)
    yield thread
    assert thread.server.state.engine.num_unfinished_requests == 0
    thread.stop()


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": NAME, **body}, timeout=60)


def sigmoid(values) -> np.ndarray:
    return 1 / (1 + np.exp(-np.asarray(values, dtype=np.float64)))


def check_scores(server, query: str, documents: list[str], reference: np.ndarray,
                 num_tokens: int) -> None:
    """Rerank (both versions) and score answer `reference`, best first; usage counts
    `num_tokens` (the pairs' tokens as the model reads them)."""
    assert np.ptp(reference) > 1e-2, reference
    for path in ("/v1/rerank", "/v2/rerank"):
        ranked = post(server, path, query=query, documents=documents).json()
        assert [r["index"] for r in ranked["results"]] == list(np.argsort(-reference))
        by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
        np.testing.assert_allclose([by_index[i] for i in range(len(documents))], reference,
                                   atol=1e-4)
        assert ranked["usage"]["total_tokens"] == num_tokens
    scored = post(server, "/v1/score", text_1=query, text_2=documents).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], reference, atol=1e-4)
    assert scored["usage"]["prompt_tokens"] == num_tokens


# ---------------------------------------------------------------- XLM-RoBERTa
@pytest.fixture(scope="module")
def xlmr_dir(tmp_path_factory):
    return build_tiny_xlm_roberta(tmp_path_factory.mktemp("xlmr-reranker"), "classify")


@pytest.fixture(scope="module")
def xlmr_server(xlmr_dir):
    yield from serve(xlmr_dir)


def xlmr_reference(model_dir, documents: list[str], **tokenizer_args) -> np.ndarray:
    from transformers import AutoTokenizer, XLMRobertaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = XLMRobertaForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        batch = tokenizer([QUERY] * len(documents), documents, padding=True,
                          return_tensors="pt", **tokenizer_args)
        return torch.sigmoid(model(**batch).logits[:, 0]).double().numpy()


def test_xlm_roberta_cross_encoder(xlmr_server, xlmr_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(xlmr_dir)
    num_tokens = sum(len(tokenizer(QUERY, d).input_ids) for d in DOCUMENTS)
    check_scores(xlmr_server, QUERY, DOCUMENTS, xlmr_reference(xlmr_dir, DOCUMENTS),
                 num_tokens)
    sentence_transformers = pytest.importorskip("sentence_transformers")
    theirs = sentence_transformers.CrossEncoder(str(xlmr_dir), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS])
    scored = post(xlmr_server, "/v1/score", text_1=QUERY, text_2=DOCUMENTS).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], theirs, atol=1e-4)


def test_xlm_roberta_truncation_and_refusals(xlmr_server, xlmr_dir):
    # max_tokens_per_doc cuts the document of the pair, as the tokenizer's only_second.
    ranked = post(xlmr_server, "/v1/rerank", query=QUERY, documents=DOCUMENTS,
                  max_tokens_per_doc=16).json()
    reference = xlmr_reference(xlmr_dir, DOCUMENTS, truncation="only_second", max_length=16)
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    np.testing.assert_allclose([by_index[i] for i in range(len(DOCUMENTS))], reference,
                               atol=1e-4)
    too_long = post(xlmr_server, "/v1/rerank", query=QUERY, documents=[" memory" * 80])
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"  # 64 tokens
    embeddings = post(xlmr_server, "/v1/embeddings", input="hi")
    assert embeddings.status_code == 400 and "cross-encoder" in embeddings.json()[
        "error"]["message"]


# ---------------------------------------------------------------- decoders
@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return build_tiny_decoder_reranker(tmp_path_factory.mktemp("qwen3-seq-cls"), "qwen3")


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir):
    yield from serve(qwen3_dir)


def test_qwen3_sequence_classification(qwen3_server, qwen3_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    model = AutoModelForSequenceClassification.from_pretrained(qwen3_dir).eval()
    prompts = [tokenizer(QUERY + d).input_ids for d in DOCUMENTS]  # vLLM's: one text
    with torch.inference_mode():
        reference = sigmoid([model(torch.tensor([p])).logits[0, 0].item() for p in prompts])
    check_scores(qwen3_server, QUERY, DOCUMENTS, reference, sum(map(len, prompts)))
    chat = post(qwen3_server, "/v1/chat/completions",
                messages=[{"role": "user", "content": "hi"}])
    assert chat.status_code == 400


@pytest.fixture(scope="module")
def original_dir(tmp_path_factory):
    return build_tiny_decoder_reranker(tmp_path_factory.mktemp("qwen3-reranker"), "qwen3",
                                       original=True)


@pytest.fixture(scope="module")
def original_server(original_dir):
    yield from serve(original_dir, "--hf-overrides", json.dumps(QWEN3_RERANKER_OVERRIDES))


def test_original_qwen3_reranker_with_hf_overrides(original_server, original_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(original_dir)
    no_id, yes_id = tokenizer.convert_tokens_to_ids(["no", "yes"])
    model = AutoModelForCausalLM.from_pretrained(original_dir).eval()
    pairs = [qwen3_reranker_pair(QUERY, d) for d in DOCUMENTS]
    prompts = [tokenizer(q + d).input_ids for q, d in pairs]
    with torch.inference_mode():  # the reranker's own: P(yes) over [no, yes]
        last = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in prompts])
        reference = torch.softmax(last[:, [no_id, yes_id]].double(), dim=-1)[:, 1].numpy()
    query = pairs[0][0]  # the same formatted query for every document
    check_scores(original_server, query, [d for _, d in pairs], reference,
                 sum(map(len, prompts)))
    # text_1 as a list, one per text_2
    scored = post(original_server, "/v1/score", text_1=[query] * 2,
                  text_2=[pairs[1][1], pairs[0][1]]).json()
    np.testing.assert_allclose([d["score"] for d in scored["data"]], reference[[1, 0]],
                               atol=1e-4)


def test_bad_hf_overrides_stop_the_cli():
    from server.http.cli import make_arg_parser

    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--hf-overrides", '{"vocab_size": 8}'])


def test_pairs_are_read_as_each_family_reads_them():
    """A decoder's pair is the one text query + document even where its tokenizer has a
    pair template (Llama's puts BOS before each text); an encoder's is its template."""
    from types import SimpleNamespace

    from tokenizers.processors import TemplateProcessing

    from server.apis.embeddings.routes import _pair_prompt
    from tests.support.reranker_fixtures import build_reranker_tokenizer, build_xlmr_tokenizer

    decoder = build_reranker_tokenizer()
    bos = decoder.convert_tokens_to_ids("<|im_start|>")
    decoder._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B:1",
        special_tokens=[("<|im_start|>", bos)])
    state = SimpleNamespace(tokenizer=decoder, max_model_len=512, pairs_as_one_text=True)
    ids, type_start = _pair_prompt(state, QUERY, DOCUMENTS[0], None)
    assert ids == decoder(QUERY + DOCUMENTS[0]).input_ids and type_start is None
    assert ids.count(bos) == 1 and decoder(QUERY, DOCUMENTS[0]).input_ids.count(bos) == 2
    cut, _ = _pair_prompt(state, QUERY, DOCUMENTS[0], 10)
    assert cut == ids[:10]  # truncation keeps the start of the one text

    encoder = build_xlmr_tokenizer()
    state = SimpleNamespace(tokenizer=encoder, max_model_len=64, pairs_as_one_text=False)
    ids, type_start = _pair_prompt(state, QUERY, DOCUMENTS[0], None)
    tokens = encoder.convert_ids_to_tokens(ids)
    middle = tokens.index("</s>")
    assert tokens[0] == "<s>" and tokens[middle:middle + 2] == ["</s>", "</s>"]
    assert tokens[-1] == "</s>" and tokens.count("</s>") == 3 and type_start is None
