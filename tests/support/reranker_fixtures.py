"""Tiny random rerankers and embedders beside BERT, built offline (no hub), with the
references they are checked against.

    build_xlmr_tokenizer()                       XLM-RoBERTa's tokenizer class (Unigram,
                                                 <s> q </s></s> d </s>) on a small vocabulary
    build_tiny_xlm_roberta(dir, "classify")      XLMRobertaForSequenceClassification (or
                                                 "mean" / "cls": XLMRobertaModel + modules.json)
    build_tiny_decoder_reranker(dir, "qwen3")    Qwen3ForSequenceClassification (score head)
    build_tiny_decoder_reranker(dir, "qwen3", original=True)
                                                 a causal LM whose "no" / "yes" logits score
                                                 (Qwen3-Reranker), served with QWEN3_RERANKER_OVERRIDES
    qwen3_reranker_pair(query, document)         the texts Qwen3-Reranker's prompt format makes
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

from tests.support.model_fixtures import (
    build_hf_model,
    build_tiny_tokenizer,
    randomize_constant_weights,
    tiny_config,
)

QUERY = "How do paged KV caches save memory?"
DOCUMENTS = [" Blocks are allocated on demand, so no memory is reserved for unused context.",
             " The weather in Paris is mild in spring.",
             " Prefix caching shares the blocks of a common prompt between requests.",
             " A paged KV cache stores keys and values in fixed-size blocks."]

# vLLM's flags for the original (causal-LM) Qwen3-Reranker.
QWEN3_RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"],
                            "classifier_from_token": ["no", "yes"],
                            "is_original_qwen3_reranker": True}
QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n")
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = ("Given a web search query, retrieve relevant passages that "
                              "answer the query")


def qwen3_reranker_pair(query: str, document: str,
                        instruction: str = QWEN3_RERANKER_INSTRUCTION) -> tuple[str, str]:
    """(text_1, text_2) in Qwen3-Reranker's format, as vLLM's example sends them: the
    server reads text_1 + text_2 as one prompt."""
    return (f"{QWEN3_RERANKER_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n",
            f"<Document>: {document}{QWEN3_RERANKER_SUFFIX}")


def build_xlmr_tokenizer():
    """transformers' XLMRobertaTokenizer (a Unigram model with XLM-R's special tokens <s>
    0, <pad> 1, </s> 2, <unk> 3 and its pair template) over the words of QUERY and
    DOCUMENTS, and single characters for the rest."""
    from transformers import XLMRobertaTokenizer

    words = {w.strip(string.punctuation) for text in [QUERY, *DOCUMENTS] for w in text.split()}
    pieces = {f"\u2581{w}": -1.0 for w in sorted(words) if w}
    for char in string.ascii_letters + string.digits + string.punctuation:
        pieces.setdefault(char, -5.0)
        pieces.setdefault(f"\u2581{char}", -5.5)
    pieces["\u2581"] = -6.0
    specials = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("<mask>", 0.0)]
    return XLMRobertaTokenizer(vocab=specials + list(pieces.items()))


def build_tiny_xlm_roberta(out_dir: str | Path, pooling: str, seed: int = 0) -> Path:
    """A 2-layer XLM-RoBERTa of hidden size 32 and its tokenizer in `out_dir`: pooling
    "classify" a cross-encoder (one label, head weights spread so the scores differ),
    "mean" or "cls" an XLMRobertaModel with sentence-transformers' modules.json saying so.
    Its position table has 66 rows (64 tokens: positions start at pad_token_id + 1)."""
    from transformers import XLMRobertaConfig
    from transformers import XLMRobertaForSequenceClassification as HFClassifier
    from transformers import XLMRobertaModel as HFModel

    out_dir = Path(out_dir)
    tokenizer = build_xlmr_tokenizer()
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, type_vocab_size=1, max_position_embeddings=66, num_labels=1,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, initializer_range=0.2)
    torch.manual_seed(seed)
    model = (HFClassifier if pooling == "classify" else HFModel)(config).eval()
    with torch.no_grad():  # position rows differ enough that an offset shows
        model.base_model.embeddings.position_embeddings.weight.normal_(0, 0.5)
        if pooling == "classify":
            model.classifier.dense.weight.normal_(0, 0.5)
            model.classifier.out_proj.weight.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if pooling != "classify":
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        (out_dir / "modules.json").write_text(json.dumps(modules))
        (out_dir / "1_Pooling").mkdir(exist_ok=True)
        (out_dir / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean"}))
    return out_dir


def build_reranker_tokenizer():
    """The tiny byte-level BPE tokenizer of model_fixtures with "no" and "yes" as tokens
    of their own (Qwen's vocabulary has both), and no chat template: sentence-transformers
    (6.x) reads a pair through the chat template where the tokenizer has one, and as
    the two texts' tokens back to back (what the server reads here) where it has none."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_tokens(["no", "yes"])
    tokenizer.chat_template = None
    return tokenizer


def build_tiny_decoder_reranker(out_dir: str | Path, arch: str = "qwen3", *,
                                original: bool = False, seed: int = 0,
                                **config_overrides) -> Path:
    """A tiny random decoder reranker of `arch` (llama, qwen2, qwen3) and its tokenizer:
    a *ForSequenceClassification checkpoint (one label, score head spread so the scores
    differ), or with `original` a causal LM scored from its "no" / "yes" logits. Its
    context is 512 tokens (a pair in Qwen3-Reranker's format takes ~300 of this tokenizer's)."""
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    config_overrides.setdefault("max_position_embeddings", 512)
    tokenizer = build_reranker_tokenizer()
    if original:
        model = build_hf_model(tiny_config(arch, **config_overrides), seed)
    else:
        name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
        config = tiny_config(arch, architectures=[f"{name}ForSequenceClassification"],
                             num_labels=1, **config_overrides)
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed + 1)
        randomize_constant_weights(model, generator)
        with torch.no_grad():
            model.score.weight.copy_(0.3 * torch.randn(model.score.weight.shape,
                                                       generator=generator))
        model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
