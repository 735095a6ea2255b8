"""XLM-RoBERTa against transformers on the same tiny random weights: the encoder's hidden
states (positions from padding_idx + 1, requests packed in one step and alone), its
embeddings through the engine with the checkpoint's pooling (mean, cls), and the
cross-encoder's pair scores (bge-reranker style: RobertaClassificationHead on <s>, the
tokenizer's <s> q </s></s> d </s>) against transformers' and sentence-transformers'
CrossEncoder.predict."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import LLM
from engine.attention.forward_context import set_forward_context
from engine.model_loader import load_model
from engine.model_loader.pooling_config import is_cross_encoder, read_pooling_config
from tests.support.model_fixtures import prefill_metadata
from tests.support.reranker_fixtures import DOCUMENTS, QUERY, build_tiny_xlm_roberta

TEXTS = [QUERY, *DOCUMENTS, "Hi"]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory):
    return build_tiny_xlm_roberta(tmp_path_factory.mktemp("xlmr-mean"), "mean")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return build_tiny_xlm_roberta(tmp_path_factory.mktemp("xlmr-reranker"), "classify")


def run_packed(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Our model's hidden states of `prompts` computed in one step; one tensor each."""
    lengths = [len(p) for p in prompts]
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lengths for i in range(n)])
    with torch.inference_mode(), set_forward_context(prefill_metadata(lengths), None):
        hidden = model(input_ids, positions)
    return list(hidden.split(lengths))


def test_encoder_matches_transformers_packed_and_alone(encoder_dir):
    from transformers import AutoTokenizer, XLMRobertaModel

    hf = XLMRobertaModel.from_pretrained(encoder_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir)
    ours = load_model(encoder_dir, dtype="float32")
    assert type(ours).__name__ == "XLMRobertaModel" and ours.max_positions == 64
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    for prompt, rows in zip(prompts, run_packed(ours, prompts), strict=True):
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).last_hidden_state[0]
            # Positions counted from 0 (BERT's) give other states: the offset is seen.
            unshifted = hf(torch.tensor([prompt]),
                           position_ids=torch.arange(len(prompt))[None]).last_hidden_state[0]
        torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-4)
        assert (unshifted - expected).abs().max() > 1e-2
        torch.testing.assert_close(run_packed(ours, [prompt])[0], rows, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_embeddings_through_the_engine(tmp_path, pooling):
    from transformers import AutoTokenizer, XLMRobertaModel

    model_dir = build_tiny_xlm_roberta(tmp_path, pooling)
    assert read_pooling_config(model_dir).pooling.pooling_type == pooling
    assert not is_cross_encoder(model_dir)
    hf = XLMRobertaModel.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    llm = LLM(str(model_dir), dtype="float32")
    try:
        assert llm.max_model_len == 64  # 66 position rows less padding_idx + 1
        outputs = llm.embed(prompts, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            hidden = hf(torch.tensor([prompt])).last_hidden_state[0]
        expected = hidden.mean(0) if pooling == "mean" else hidden[0]
        np.testing.assert_allclose(output.pooled, expected.numpy(), atol=1e-5, rtol=1e-4)


def test_cross_encoder_matches_transformers_and_sentence_transformers(reranker_dir):
    from transformers import AutoTokenizer, XLMRobertaForSequenceClassification

    assert is_cross_encoder(reranker_dir)
    assert read_pooling_config(reranker_dir).pooling.pooling_type == "classify"
    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    encoded = [tokenizer(QUERY, document) for document in DOCUMENTS]
    assert "token_type_ids" not in encoded[0]  # one segment: XLM-R has no token types
    first = tokenizer.convert_ids_to_tokens(encoded[0].input_ids)
    assert first[0] == "<s>" and first[-1] == "</s>" and ["</s>", "</s>"] == first[
        first.index("</s>"):first.index("</s>") + 2]
    prompts = [list(e.input_ids) for e in encoded]
    hf = XLMRobertaForSequenceClassification.from_pretrained(reranker_dir).eval()
    with torch.inference_mode():
        batch = tokenizer([QUERY] * len(DOCUMENTS), DOCUMENTS, padding=True,
                          return_tensors="pt")
        reference = torch.sigmoid(hf(**batch).logits[:, 0]).numpy()
    assert np.ptp(reference) > 1e-2, reference
    llm = LLM(str(reranker_dir), dtype="float32")
    try:
        logits = [o.pooled for o in llm.embed(prompts, use_tqdm=False)]
    finally:
        llm.shutdown()
    scores = 1 / (1 + np.exp(-np.asarray(logits)[:, 0]))
    np.testing.assert_allclose(scores, reference, atol=1e-4)
    assert list(np.argsort(-scores)) == list(np.argsort(-reference))
    sentence_transformers = pytest.importorskip("sentence_transformers")
    theirs = sentence_transformers.CrossEncoder(str(reranker_dir), device="cpu").predict(
        [(QUERY, d) for d in DOCUMENTS])
    np.testing.assert_allclose(scores, theirs, atol=1e-4)


def test_checkpoint_errors(reranker_dir):
    model = load_model(reranker_dir, dtype="float32")
    state = load_file(str(reranker_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="no place in XLMRobertaForSequenceClassification"):
        model.load_weights([*state.items(), ("classifier.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="unfilled"):
        model.load_weights([(n, t) for n, t in state.items() if "out_proj" not in n])
