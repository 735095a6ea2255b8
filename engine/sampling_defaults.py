"""What a request's unset sampling fields take: the server owner's and the model's defaults.

One field of one request takes the first of these that is set:

    1. the request's own value
    2. the server owner's: --override-generation-config '{"temperature": 0.7}',
       --max-tokens-default (the output cap)
    3. the model's generation config (--generation-config auto: its generation_config.json,
       or a GGUF's general.sampling.* keys; PATH: the generation_config.json in that
       folder; vllm: none), as vLLM reads it
    4. the API's own documented default (Ollama: temperature 0.8, top_k 40, top_p 0.9)
    5. neutral: temperature 1, top_p 1, top_k all, min_p 0, repetition_penalty 1, and no
       cap but the context (max_tokens: the room the prompt leaves)

Example, Llama 3.1 Instruct (generation_config.json: temperature 0.6, top_p 0.9) served
with --override-generation-config '{"temperature": 0.2}' --max-tokens-default 512:
defaults {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512}; an OpenAI request with
only top_p 0.5 samples at temperature 0.2, top_p 0.5, at most 512 tokens.

Loading needs no torch (the HTTP frontend keeps torch out of its process).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# generation_config.json's name -> the request's (SamplingParams') name: what vLLM reads.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# A GGUF file's general.sampling.* keys (llama.cpp writes them from a model's own
# recommendations) -> generation_config.json's names.
GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder's path

logger = logging.getLogger(__name__)

# Ollama's documented defaults (its Modelfile reference): what an unset option takes there.
OLLAMA_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}


def _check(name: str, value: Any) -> float | int:
    """`value` of the request field `name`, checked; ValueError says what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    ok = {
        "temperature": value >= 0,
        "top_p": 0 < value <= 1,
        "top_k": value == int(value) and value >= -1,
        "min_p": 0 <= value <= 1,
        "repetition_penalty": value > 0,
        "max_tokens": value == int(value) and value >= 1,
    }[name]
    if not ok:
        raise ValueError(f"{name} = {value!r} is out of range")
    return int(value) if name in ("top_k", "max_tokens") else float(value)


def sampling_fields(generation_config: Mapping[str, Any], source: str,
                    strict: bool = True) -> dict[str, Any]:
    """The sampling defaults in a generation config (generation_config.json's names), by
    the request's names; keys it does not carry (eos_token_id, do_sample, ...) are left
    out, as vLLM does. A bad value is a ValueError naming `source`, or with `strict`
    False a warning and the value left out (a model's odd file does not stop it serving)."""
    fields = {}
    for key, name in GENERATION_CONFIG_KEYS.items():
        value = generation_config.get(key)
        if value is None:
            continue
        try:
            fields[name] = _check(name, value)
        except ValueError as exc:
            if strict:
                raise ValueError(f"{source}: {key}: {exc}") from None
            logger.warning("%s: %s: %s; ignored", source, key, exc)
    return fields


def override_fields(override: Mapping[str, Any]) -> dict[str, Any]:
    """--override-generation-config's JSON object by the request's names; a key that is
    not a sampling default is refused (it would otherwise be ignored without a word)."""
    unknown = sorted(set(override) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown key(s) {unknown}; "
                         f"expected some of {sorted(GENERATION_CONFIG_KEYS)}")
    return sampling_fields(override, "--override-generation-config")


def read_generation_config_file(folder: str | Path) -> dict[str, Any]:
    """--generation-config PATH: the generation_config.json in that folder (a missing or
    unreadable one is an error: the owner asked for it)."""
    path = Path(folder) / "generation_config.json"
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config {folder}: cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--generation-config {folder}: {path} is not a JSON object")
    return value


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults in force (steps 2 and 3 above), by the request's field names."""

    fields: dict[str, Any] = field(default_factory=dict)
    # Where each field came from: "--override-generation-config", "--max-tokens-default",
    # or the model's generation config (its path).
    sources: dict[str, str] = field(default_factory=dict)

    def value(self, name: str, api_defaults: Mapping[str, Any] | None = None) -> Any:
        """The default of request field `name` (None: the neutral value applies)."""
        if name in self.fields:
            return self.fields[name]
        return (api_defaults or {}).get(name)

    def describe(self) -> str:
        """One line for the start-up log."""
        if not self.fields:
            return "sampling defaults: none (temperature 1, top_p 1, all top_k, no output cap)"
        return "sampling defaults: " + ", ".join(
            f"{name} {value} ({self.sources[name]})" for name, value in self.fields.items())


def check_owner_settings(mode: str, override: Mapping[str, Any] | None,
                         max_tokens_default: int | None) -> None:
    """The owner's settings on their own (before any model is read; the folder of
    --generation-config PATH is read by its flag's parser): ValueError for an unknown or
    bad override, or two output caps."""
    owner = override_fields(override or {})
    if max_tokens_default is not None and "max_tokens" in owner:
        raise ValueError("--max-tokens-default and --override-generation-config's "
                         "max_new_tokens both set the output cap: keep one")


def resolve_sampling_defaults(mode: str, model_generation_config: Mapping[str, Any],
                              override: Mapping[str, Any] | None = None,
                              max_tokens_default: int | None = None,
                              model_source: str = "the model's generation_config.json"
                              ) -> SamplingDefaults:
    """The defaults of a server (or `LLM`) from its flags and the model's generation
    config (read by engine.model_loader.resources). `mode`: "auto", "vllm" or a folder.
    Raises ValueError for a bad value, an unknown override key, or --max-tokens-default
    together with an override's max_new_tokens (two owner caps: say which)."""
    if mode == "vllm":
        model_fields, source = {}, ""
    elif mode == "auto":
        model_fields = sampling_fields(model_generation_config, model_source, strict=False)
        source = model_source
    else:
        source = str(Path(mode) / "generation_config.json")
        model_fields = sampling_fields(read_generation_config_file(mode), source)
    check_owner_settings(mode, override, max_tokens_default)
    owner = override_fields(override or {})
    if max_tokens_default is not None:
        owner["max_tokens"] = _check("max_tokens", max_tokens_default)
    fields = {**model_fields, **owner}
    sources = {name: source for name in model_fields}
    sources.update({name: "--override-generation-config" for name in owner})
    if max_tokens_default is not None:
        sources["max_tokens"] = "--max-tokens-default"
    ordered = {name: fields[name] for name in GENERATION_CONFIG_KEYS.values() if name in fields}
    return SamplingDefaults(ordered, {name: sources[name] for name in ordered})
