"""Decoder rerankers against transformers on the same tiny random weights, through the
engine (`LLM.embed` with the model's own pooling, "classify" on each prompt's last
token): Llama / Qwen2 / Qwen3 *ForSequenceClassification checkpoints (and
sentence-transformers' CrossEncoder.predict on them), and a causal-LM Qwen3-Reranker
served with vLLM's --hf-overrides, its score P(yes) = softmax over the last token's
[no, yes] logits. Pairs are read as one text, query + document (vLLM's)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from engine import LLM
from engine.config import check_hf_overrides, hf_overrides_json
from engine.model_loader.pooling_config import (
    is_cross_encoder,
    model_runner_kind,
    pairs_as_one_text,
    read_pooling_config,
)
from tests.support.reranker_fixtures import (
    DOCUMENTS,
    QUERY,
    QWEN3_RERANKER_OVERRIDES,
    build_tiny_decoder_reranker,
    qwen3_reranker_pair,
)


def sigmoid(values) -> np.ndarray:
    return 1 / (1 + np.exp(-np.asarray(values, dtype=np.float64)))


def engine_scores(model_dir, prompts: list[list[int]], **options) -> np.ndarray:
    """sigmoid of the one-label logit of each prompt (what the server answers); the KV
    blocks each prefill wrote are freed when it finishes."""
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, **options)
    try:
        outputs = llm.embed(prompts + prompts[:1], use_tqdm=False)  # the first one twice
        assert llm.engine_core.scheduler.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()
    logits = [o.pooled for o in outputs]
    assert all(len(v) == 1 for v in logits)
    assert logits[-1] == pytest.approx(logits[0], abs=1e-6)  # alone: the same score
    return sigmoid([v[0] for v in logits[:-1]])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_sequence_classification_matches_transformers(tmp_path, arch):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model_dir = build_tiny_decoder_reranker(tmp_path, arch)
    assert is_cross_encoder(model_dir) and pairs_as_one_text(model_dir)
    assert model_runner_kind(model_dir) == "pooling"
    assert read_pooling_config(model_dir).pooling.pooling_type == "classify"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(QUERY + document).input_ids for document in DOCUMENTS]
    hf = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        reference = sigmoid([hf(torch.tensor([p])).logits[0, 0].item() for p in prompts])
    assert np.ptp(reference) > 1e-2, reference
    scores = engine_scores(model_dir, prompts)
    np.testing.assert_allclose(scores, reference, atol=1e-4)
    assert list(np.argsort(-scores)) == list(np.argsort(-reference))
    # sentence-transformers reads the pair with the tokenizer's pair encoding: for this
    # tokenizer (no template) the two texts' ids back to back, the same ids here.
    assert all(tokenizer(QUERY, d).input_ids == p for d, p in zip(DOCUMENTS, prompts,
                                                                   strict=True))
    sentence_transformers = pytest.importorskip("sentence_transformers")
    theirs = sentence_transformers.CrossEncoder(str(model_dir), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose(scores, theirs, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True])
def test_original_qwen3_reranker_scores_from_yes_no_logits(tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_decoder_reranker(tmp_path, "qwen3", original=True,
                                            tie_word_embeddings=tied)
    # As a causal LM it generates; the overrides make it a reranker.
    assert model_runner_kind(model_dir) == "generate" and not is_cross_encoder(model_dir)
    assert is_cross_encoder(model_dir, QWEN3_RERANKER_OVERRIDES)
    assert pairs_as_one_text(model_dir, QWEN3_RERANKER_OVERRIDES)
    assert read_pooling_config(model_dir, QWEN3_RERANKER_OVERRIDES).pooling.pooling_type == \
        "classify"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    no_id, yes_id = tokenizer.convert_tokens_to_ids(["no", "yes"])
    prompts = [tokenizer("".join(qwen3_reranker_pair(QUERY, d))).input_ids for d in DOCUMENTS]
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():  # Qwen3-Reranker's own scoring: P(yes) of [no, yes]
        last = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
        reference = torch.softmax(last[:, [no_id, yes_id]].double(), dim=-1)[:, 1].numpy()
    assert np.ptp(reference) > 1e-2, reference
    scores = engine_scores(model_dir, prompts, hf_overrides=QWEN3_RERANKER_OVERRIDES)
    np.testing.assert_allclose(scores, reference, atol=1e-4)
    assert list(np.argsort(-scores)) == list(np.argsort(-reference))


def test_a_token_outside_the_vocabulary_stops_the_start(tmp_path):
    model_dir = build_tiny_decoder_reranker(tmp_path, "qwen3", original=True)
    overrides = {**QWEN3_RERANKER_OVERRIDES, "classifier_from_token": ["nope", "yes"]}
    with pytest.raises(Exception, match="'nope' is not a token"):
        LLM(str(model_dir), dtype="float32", max_model_len=64, hf_overrides=overrides)


@pytest.mark.parametrize("overrides,message", [
    ({"vocab_size": 10}, "'vocab_size' cannot be overridden"),
    ({"architectures": "Qwen3ForSequenceClassification"}, "list of class names"),
    ({"classifier_from_token": ["yes"]}, "two tokens"),
    ({"is_original_qwen3_reranker": True}, "needs classifier_from_token"),
    ({"method": "no_post_processing", "classifier_from_token": ["no", "yes"]},
     "from_2_way_softmax"),
])
def test_hf_overrides_are_checked(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_hf_overrides(overrides)
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        hf_overrides_json(json.dumps(overrides))
    check_hf_overrides(QWEN3_RERANKER_OVERRIDES)
