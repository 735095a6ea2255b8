"""A model's own pooling, as sentence-transformers saves it beside the weights.

    modules.json                 [Transformer, Pooling (path "1_Pooling"), Normalize]
    1_Pooling/config.json        {"pooling_mode_mean_tokens": true, ...}
    sentence_bert_config.json    {"max_seq_length": 256}
    config_sentence_transformers.json  {"prompts": {"query": "..."}}   (some models)

-> PoolingConfig(PoolingParams("mean", normalize=True), max_seq_length=256).

A checkpoint without modules.json pools as vLLM does by default: an encoder (BERT and
its kind) its [CLS] token, a decoder its last token; both normalized. A cross-encoder
(a classification head: BERT's or XLM-RoBERTa's on [CLS], a decoder reranker's on the
last token) gives its raw logits. --hf-overrides (engine/model_loader/hf_config.py) may
rename the architecture (a causal-LM Qwen3-Reranker read as Qwen3ForSequenceClassification);
every reader here takes them. Loading needs no torch (the HTTP frontend reads it too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.pooling_params import PoolingParams

# Decoder rerankers (engine/models/sequence_classification.py): a score head on the last
# token. vLLM's "LLM as reranker": a pair is read as one text, query + document.
DECODER_RERANKER_ARCHITECTURES = frozenset({
    "LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
    "Qwen3ForSequenceClassification"})
# Those that score pairs (a cross-encoder reranker): /v1/rerank and /v1/score, no vectors.
CROSS_ENCODER_ARCHITECTURES = frozenset({
    "BertForSequenceClassification", "XLMRobertaForSequenceClassification",
    *DECODER_RERANKER_ARCHITECTURES})
# Architectures that only pool (no lm_head): they serve embeddings or scores, never text.
POOLING_ARCHITECTURES = frozenset({"BertModel", "XLMRobertaModel",
                                   *CROSS_ENCODER_ARCHITECTURES})
# Encoders: without modules.json they pool their [CLS] token.
_ENCODER_ARCHITECTURES = POOLING_ARCHITECTURES - DECODER_RERANKER_ARCHITECTURES

# 1_Pooling/config.json's flags -> our pooling type (the first one set wins).
POOLING_MODE_FLAGS = (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"),
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


def _model_config(model_dir: str | Path, hf_overrides: dict[str, Any] | None) -> dict:
    """config.json's values ({} without a readable one), `hf_overrides` set over them."""
    config = _read_json(Path(model_dir) / "config.json")
    return {**(config if isinstance(config, dict) else {}), **(hf_overrides or {})}


def _architectures(model_dir: str | Path, hf_overrides: dict[str, Any] | None = None
                   ) -> set[str]:
    """config.json's `architectures` (empty without a readable one), or the overrides'."""
    return set(_model_config(model_dir, hf_overrides).get("architectures") or [])


def _sbert_modules(model_dir: Path) -> dict[str, dict] | None:
    """modules.json's modules by their type's last name ({"Pooling": {"path": "1_Pooling",
    ...}, "Normalize": ...}); None without a readable modules.json."""
    modules = _read_json(model_dir / "modules.json")
    if not isinstance(modules, list):
        return None
    return {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}


def _pooling_module_config(model_dir: Path, modules: dict[str, dict] | None) -> dict:
    """The Pooling module's config.json (1_Pooling/config.json), {} without one."""
    if not modules or "Pooling" not in modules:
        return {}
    flags = _read_json(model_dir / modules["Pooling"].get("path", "") / "config.json")
    return flags if isinstance(flags, dict) else {}


@dataclass(frozen=True)
class EmbeddingPrompts:
    """config_sentence_transformers.json's prompts: text put before an input, by name
    (e5: {"query": "query: ", "passage": "passage: "}), and the one sentence-transformers'
    encode applies when the caller names none."""

    prompts: dict[str, str]
    default_name: str | None = None
    pooled: bool = True  # the Pooling module's include_prompt: false leaves prompts out


def read_embedding_prompts(model_dir: str | Path) -> EmbeddingPrompts:
    """The checkpoint's named prompts ({} without them); a default name that is not one
    of them is dropped, as sentence-transformers refuses it."""
    config = _read_json(Path(model_dir) / "config_sentence_transformers.json")
    config = config if isinstance(config, dict) else {}
    prompts = config.get("prompts") if isinstance(config.get("prompts"), dict) else {}
    prompts = {str(k): v for k, v in prompts.items() if isinstance(v, str)}
    default = config.get("default_prompt_name")
    model_dir = Path(model_dir)
    flags = _pooling_module_config(model_dir, _sbert_modules(model_dir))
    return EmbeddingPrompts(prompts, default if default in prompts else None,
                            bool(flags.get("include_prompt", True)))


def is_torch_encoder(model: str | Path) -> bool:
    """Whether `model` (a checkpoint directory, or a llama.cpp `bert` GGUF file) is an
    encoder (BERT, XLM-RoBERTa) whose forward is a chain of small torch ops rather than
    the decoders' fused kernels; False for anything else or unreadable."""
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        from engine.model_loader.gguf_file import GGUFFile

        try:  # gguf_bert.is_bert's test (that module imports this one)
            return GGUFFile(path).metadata.get("general.architecture") == "bert"
        except ValueError:
            return False
    return bool(_architectures(path) & _ENCODER_ARCHITECTURES)


def read_pooling_config(model_dir: str | Path,
                        hf_overrides: dict[str, Any] | None = None) -> PoolingConfig:
    """The checkpoint's pooling (see the module doc). A pooling mode we do not have
    (max, mean_sqrt_len) is a ValueError naming it."""
    model_dir = Path(model_dir)
    architectures = _architectures(model_dir, hf_overrides)
    if architectures & CROSS_ENCODER_ARCHITECTURES:  # its head scores pairs: raw logits
        return PoolingConfig(PoolingParams("classify", normalize=False))
    sbert = _read_json(model_dir / "sentence_bert_config.json")
    max_seq_length = sbert.get("max_seq_length") if isinstance(sbert, dict) else None
    types = _sbert_modules(model_dir)
    default_type = "cls" if architectures & _ENCODER_ARCHITECTURES else "last"
    if types is None:
        return PoolingConfig(PoolingParams(default_type, normalize=True), max_seq_length)
    flags = _pooling_module_config(model_dir, types)
    chosen = [ours for flag, ours in POOLING_MODE_FLAGS if flags.get(flag)]
    unsupported = [flag for flag in ("pooling_mode_max_tokens",
                                     "pooling_mode_mean_sqrt_len_tokens") if flags.get(flag)]
    if unsupported or len(chosen) > 1:
        raise ValueError(f"{model_dir}: pooling {', '.join(unsupported) or chosen} is not "
                         "supported (mean, cls or last token)")
    pooling_type = chosen[0] if chosen else default_type
    return PoolingConfig(PoolingParams(pooling_type, normalize="Normalize" in types),
                         max_seq_length if isinstance(max_seq_length, int) else None)


def model_runner_kind(model_dir: str | Path, runner: str = "auto",
                      hf_overrides: dict[str, Any] | None = None) -> str:
    """"generate" or "pooling": what the model in `model_dir` serves under --runner
    `runner` (vLLM's flag): auto follows config.json's architectures (an encoder such as
    BertModel, or a reranker, pools; a decoder generates); `pooling` makes a decoder an
    embedder (its last token's hidden state, Qwen3-Embedding style). ValueError for a
    pooling-only model asked to generate."""
    architectures = _architectures(model_dir, hf_overrides)
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


def is_cross_encoder(model_dir: str | Path, hf_overrides: dict[str, Any] | None = None
                     ) -> bool:
    """Whether config.json names a cross-encoder (a classification head over pairs)."""
    return bool(_architectures(model_dir, hf_overrides) & CROSS_ENCODER_ARCHITECTURES)


def pairs_as_one_text(model_dir: str | Path, hf_overrides: dict[str, Any] | None = None
                      ) -> bool:
    """Whether the cross-encoder reads a (query, document) pair as one text, query +
    document, as vLLM reads them for a decoder reranker (its `use_pad_token` false, the
    default there); else as the tokenizer's pair template gives it (BERT: [CLS] q [SEP]
    d [SEP], XLM-RoBERTa: <s> q </s></s> d </s>)."""
    config = _model_config(model_dir, hf_overrides)
    decoder = bool(set(config.get("architectures") or []) & DECODER_RERANKER_ARCHITECTURES)
    return decoder and not config.get("use_pad_token", False)
