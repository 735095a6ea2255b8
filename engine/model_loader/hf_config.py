"""A model's transformers config as the engine builds it: config.json, then --hf-overrides.

    config = load_hf_config(model_dir, {"architectures": ["Qwen3ForSequenceClassification"],
                                        "classifier_from_token": ["no", "yes"],
                                        "is_original_qwen3_reranker": True})
    config.architectures               ["Qwen3ForSequenceClassification"]
    config.classifier_from_token_ids   [2152, 9693]   (the tokenizer's ids of "no", "yes")

--hf-overrides takes only the keys of engine.config.HF_OVERRIDE_KEYS: what serves a
causal-LM reranker (Qwen3-Reranker) as a sequence classifier scored from two tokens'
logits (engine/models/sequence_classification.py), as vLLM spells them. The torch-free
frontend reads the same overrides over config.json's JSON
(engine/model_loader/pooling_config.py: the architectures decide the endpoints).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.config import scores_from_two_tokens


def load_hf_config(model_dir: str | Path, hf_overrides: dict[str, Any] | None = None):
    """config.json's transformers config with `hf_overrides` set on it; for a reranker
    scored from two tokens, `classifier_from_token_ids` too (their ids in the model's
    tokenizer). ValueError for a token that is not one token of the vocabulary."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in (hf_overrides or {}).items():
        setattr(config, key, value)
    if scores_from_two_tokens(config):
        config.classifier_from_token_ids = _token_ids(model_dir, config.classifier_from_token)
    return config


def _token_ids(model_dir: str | Path, tokens: list[str | int]) -> list[int]:
    """The ids of `tokens` (texts of single tokens, as the vocabulary spells them, or ids)."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model_dir).get_vocab()
    ids = []
    for token in tokens:
        if isinstance(token, int):
            ids.append(token)
        elif token in vocab:
            ids.append(vocab[token])
        else:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of "
                             f"{model_dir}'s vocabulary")
    return ids
