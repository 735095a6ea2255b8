"""A model's own pooling, as sentence-transformers saves it beside the weights.

    modules.json                 [Transformer, Pooling (path "1_Pooling"), Normalize]
    1_Pooling/config.json        {"pooling_mode_mean_tokens": true, ...}
    sentence_bert_config.json    {"max_seq_length": 256}
    config_sentence_transformers.json  {"prompts": {"query": "..."}}   (some models)

-> PoolingConfig(PoolingParams("mean", normalize=True), max_seq_length=256).

A checkpoint without modules.json pools as vLLM does by default: an encoder (BERT and
its kind) its [CLS] token, a decoder its last token; both normalized. A cross-encoder
(a classification head) gives its raw logits. Loading needs no
torch (the HTTP frontend reads it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.pooling_params import PoolingParams

# Architectures that only pool (no lm_head): they serve embeddings, never text.
POOLING_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification"})
# Those that score pairs (a cross-encoder reranker): /v1/rerank and /v1/score, no vectors.
CROSS_ENCODER_ARCHITECTURES = frozenset({"BertForSequenceClassification"})

# 1_Pooling/config.json's flags -> our pooling type (the first one set wins).
_MODES = (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
          ("pooling_mode_lasttoken", "last"))


@dataclass(frozen=True)
class PoolingConfig:
    pooling: PoolingParams
    # sentence_bert_config.json's max_seq_length: where sentence-transformers truncates
    # (the server's context for the model, unless --max-model-len says otherwise).
    max_seq_length: int | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _architectures(model_dir: str | Path) -> set[str]:
    """config.json's `architectures` (empty without a readable one)."""
    config = _read_json(Path(model_dir) / "config.json")
    return set(config.get("architectures") or []) if isinstance(config, dict) else set()


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The checkpoint's pooling (see the module doc). A pooling mode we do not have
    (max, mean_sqrt_len) is a ValueError naming it."""
    model_dir = Path(model_dir)
    architectures = _architectures(model_dir)
    if architectures & CROSS_ENCODER_ARCHITECTURES:  # its head scores pairs: raw logits
        return PoolingConfig(PoolingParams("classify", normalize=False))
    sbert = _read_json(model_dir / "sentence_bert_config.json")
    max_seq_length = sbert.get("max_seq_length") if isinstance(sbert, dict) else None
    modules = _read_json(model_dir / "modules.json")
    default_type = "cls" if architectures & POOLING_ARCHITECTURES else "last"
    if not isinstance(modules, list):
        return PoolingConfig(PoolingParams(default_type, normalize=True), max_seq_length)
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_type = default_type
    if "Pooling" in types:
        flags = _read_json(model_dir / types["Pooling"].get("path", "") / "config.json") or {}
        chosen = [ours for flag, ours in _MODES if flags.get(flag)]
        unsupported = [flag for flag in ("pooling_mode_max_tokens",
                                         "pooling_mode_mean_sqrt_len_tokens") if flags.get(flag)]
        if unsupported or len(chosen) > 1:
            raise ValueError(f"{model_dir}: pooling {', '.join(unsupported) or chosen} is not "
                             "supported (mean, cls or last token)")
        if chosen:
            pooling_type = chosen[0]
    return PoolingConfig(PoolingParams(pooling_type, normalize="Normalize" in types),
                         max_seq_length if isinstance(max_seq_length, int) else None)



def model_runner_kind(model_dir: str | Path, runner: str = "auto") -> str:
    """"generate" or "pooling": what the model in `model_dir` serves under --runner
    `runner` (vLLM's flag): auto follows config.json's architectures (an encoder such as
    BertModel pools; a decoder generates); `pooling` makes a decoder an embedder (its
    last token's hidden state, Qwen3-Embedding style). ValueError for an encoder asked
    to generate."""
    architectures = _architectures(model_dir)
    encoder = bool(architectures & POOLING_ARCHITECTURES)
    if runner == "generate" and encoder:
        raise ValueError(f"--runner generate: {', '.join(sorted(architectures))} has no "
                         "language-model head; it serves embeddings (--runner pooling)")
    return "pooling" if encoder or runner == "pooling" else "generate"


def embedding_size_of(model_dir: str | Path) -> tuple[int | None, bool]:
    """(the vector size: config.json's hidden_size, whether the model declares Matryoshka
    dimensions: `is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them)."""
    config = _read_json(Path(model_dir) / "config.json")
    if not isinstance(config, dict):
        return None, False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("hidden_size")
    return (size if isinstance(size, int) else None,
            bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions")))


def is_cross_encoder(model_dir: str | Path) -> bool:
    """Whether config.json names a cross-encoder (a classification head over pairs)."""
    return bool(_architectures(model_dir) & CROSS_ENCODER_ARCHITECTURES)
