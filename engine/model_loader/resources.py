"""What the front ends need of a model besides its weights, loaded in one place.

    resources = load_model_resources(model_dir)
    resources.tokenizer               # the Hugging Face tokenizer (chat template included)
    resources.eos_token_id            # the engine's EOS: finish_reason "stop"
    resources.extra_stop_token_ids    # the model's other end-of-sequence ids
    resources.with_model_stops(params)  # SamplingParams that also stop at those ids

The server (server/http/api_server.py), the offline `LLM` (engine/frontend/llm.py) and
the engine core's grammar compiler (engine/core/core.py) all load a model's tokenizer
here, so they agree on where a request stops.

End-of-sequence ids: generation_config.json's `eos_token_id` (one id or a list), with the
tokenizer's own EOS put first when the list lacks it. The first id is the engine's EOS;
the others stop a request as its stop_token_ids do (vLLM's rule), unless it sets
ignore_eos. Example, Llama 3 Instruct: tokenizer EOS 128009 (<|eot_id|>),
generation_config [128001, 128008, 128009] -> EOS 128001, extra [128008, 128009].
A GGUF file's EOS and end-of-turn ids reach here the same way: its conversion writes
them into the converted directory's generation_config.json (engine.model_loader.gguf).

Loading needs no torch (the HTTP frontend keeps torch out of its process).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model_loader.chat_templates import check_chat_template, choose_chat_template
from engine.model_loader.pooling_config import PoolingConfig, read_pooling_config
from engine.model_loader.source import ModelSourceError, resolve_model
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class ModelResources:
    tokenizer: Any
    eos_token_id: int | None
    extra_stop_token_ids: list[int] = field(default_factory=list)
    # generation_config.json as written ({} without one): sampling defaults for later use.
    generation_config: dict[str, Any] = field(default_factory=dict)
    # Where tokenizer.chat_template came from (engine/model_loader/chat_templates.py):
    # "the model's", "built-in gemma (the model has none)", "--chat-template FILE", ...
    chat_template_source: str = "the model's"
    # How the model pools for embeddings (engine/model_loader/pooling_config.py).
    pooling_config: PoolingConfig = PoolingConfig(PoolingParams("last"))

    @property
    def pooling(self) -> PoolingParams:
        return self.pooling_config.pooling

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def with_model_stops(self, params: SamplingParams) -> SamplingParams:
        """`params` that also stop at the model's extra EOS ids (after its own
        stop_token_ids), unless it ignores EOS; `params` itself is left as it is."""
        if params.ignore_eos:
            return params
        missing = [i for i in self.extra_stop_token_ids if i not in params.stop_token_ids]
        if not missing:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *missing])


def local_model_dir(model: str | os.PathLike) -> Path:
    """The local directory of `model` (anything resolve_model takes); a directory with a
    tokenizer but no weights (the tests' echo models) is used as it is."""
    try:
        return resolve_model(model).path
    except ModelSourceError:
        if not os.path.isdir(model):
            raise
        return Path(model)


def load_tokenizer(model: str | os.PathLike) -> Any:
    """The Hugging Face tokenizer of `model` (see local_model_dir)."""
    return _tokenizer_at(local_model_dir(model))


def _tokenizer_at(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def read_generation_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """generation_config.json of a local model directory; {} when it has none (or an
    unreadable one: a model without it still serves)."""
    try:
        value = json.loads((Path(model_dir) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def eos_token_ids(generation_config: dict[str, Any], tokenizer_eos: int | None) -> list[int]:
    """Every end-of-sequence id, the engine's EOS first (see the module doc)."""
    value = generation_config.get("eos_token_id")
    ids = [value] if isinstance(value, int) else [i for i in value or [] if isinstance(i, int)]
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.insert(0, tokenizer_eos)
    return ids


def model_type_of(model_dir: Path) -> str | None:
    """config.json's model_type (None without a readable one)."""
    try:
        value = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return value.get("model_type") if isinstance(value, dict) else None


def load_model_resources(model: str | os.PathLike, chat_template: str | None = None,
                         hf_overrides: dict[str, Any] | None = None) -> ModelResources:
    """The tokenizer, chat template, EOS ids, generation config and pooling of `model` (see
    local_model_dir). `chat_template`: --chat-template (a built-in's name, a file or
    Jinja text); `hf_overrides`: --hf-overrides (they may make the model a reranker). The
    chosen template is set on the tokenizer and checked; a broken one raises
    ChatTemplateError. A built-in template's end-of-turn markers stop requests as the
    model's extra EOS ids do."""
    model_dir = local_model_dir(model)
    tokenizer = _tokenizer_at(model_dir)
    choice = choose_chat_template(tokenizer, model_type_of(model_dir), chat_template)
    tokenizer.chat_template = choice.template
    if choice.template is not None:
        check_chat_template(tokenizer, choice.template, choice.source)
    generation_config = read_generation_config(model_dir)
    ids = eos_token_ids(generation_config, tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab() if choice.stop_tokens else {}
    for marker in choice.stop_tokens:
        if marker in vocab and vocab[marker] not in ids:
            ids.append(vocab[marker])
    return ModelResources(tokenizer, ids[0] if ids else None, ids[1:], generation_config,
                          choice.source, read_pooling_config(model_dir, hf_overrides))
