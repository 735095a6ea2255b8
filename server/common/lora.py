"""The LoRA adapters a server offers under their own model names (issue 44).

    pagedserve serve --enable-lora --lora-modules 'sql=/adapters/sql chat=/adapters/chat'
    pagedserve serve --enable-lora --lora-modules '[{"name": "chat", "path": "/a/chat"}]'
    POST /v1/load_lora_adapter {"lora_name": "sql2", "lora_path": "/adapters/sql2"}
    POST /v1/unload_lora_adapter {"lora_name": "sql2"}

A request's `model` names the base or an adapter; an adapter's requests carry its
LoRARequest to the engine. Each adapter added gets a new id (never reused), so an
adapter loaded again under an old name shares no prefix-cache blocks with the old one.
Unloading only stops new requests: those already running finish under the weights
they started with (the worker keeps an adapter while requests use it).
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from engine.lora.checkpoint import check_adapter
from engine.lora_request import LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch, honoured as is


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").lower() in ("1", "true")


def parse_lora_module(text: str) -> dict[str, str]:
    """One --lora-modules value: 'name=path' or vLLM's JSON {"name", "path",
    "base_model_name"}. Example: 'sql=/a/sql' -> {"name": "sql", "path": "/a/sql"}."""
    text = text.strip()
    if text.startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict) or not {"name", "path"} <= set(value):
            raise ValueError(f"--lora-modules {text!r}: JSON needs 'name' and 'path'")
        return {"name": str(value["name"]), "path": str(value["path"])}
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected name=path or JSON")
    return {"name": name, "path": path}


def lora_modules_list(text: str) -> list[str]:
    """--lora-modules' value -> one entry per adapter: a JSON list of entries, one JSON
    object, or name=path entries separated by spaces. Example:
    'sql=/a/sql chat=/a/chat' -> ['sql=/a/sql', 'chat=/a/chat'];
    '{"name": "chat", "path": "/a/chat"}' -> that one object (its spaces kept)."""
    text = text.strip()
    if text.startswith("["):
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise ValueError(f"--lora-modules {text!r}: expected a JSON list")
        return [e if isinstance(e, str) else json.dumps(e) for e in entries]
    if text.startswith("{"):
        return [text]
    return text.split()


class LoRAAdapters:
    """Name -> LoRARequest of the adapters served; `hf_config` is the base's (shapes)."""

    def __init__(self, hf_config: Any, max_rank: int, base_names: list[str]):
        self.hf_config = hf_config
        self.max_rank = max_rank
        self.base_names = base_names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """Check and offer the adapter at `path` as `name`; AdapterError (a 400) if the
        base cannot run it, ValueError if the name is taken (an adapter's name, with
        `replace`, is not: once the new one passed its check, it takes the name)."""
        if name in self.base_names or (name in self._by_name and not replace):
            raise ValueError(f"The model name {name!r} is already in use.")
        check_adapter(path, self.hf_config, self.max_rank)
        request = LoRARequest(name, next(self._ids), path)
        self._by_name[name] = request
        return request

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

