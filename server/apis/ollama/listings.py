"""The Ollama model listings: /api/tags, /api/ps and /api/show describe the served model."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from server.apis.ollama.protocol import OllamaModel, OllamaModelDetails
from server.common.state import ServerState

_DEFAULT_TAG = ":latest"


# ------------------------------------------------------------------ model listings
@functools.lru_cache(maxsize=8)
def model_facts(model_root: str) -> tuple[int, str, str, OllamaModelDetails]:
    """(size in bytes, digest, modified_at, details) of the model's files.

    The digest is the SHA-256 of the file names, sizes and the config (an identity of
    this model directory, not a hash of the weights, which would take a while).
    """
    root = Path(model_root)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    config: dict[str, Any] = {}
    config_path = root / "config.json"
    if config_path.is_file():
        digest.update(config_path.read_bytes())
        try:
            config = json.loads(config_path.read_text())
        except ValueError:
            config = {}
    modified = max((p.stat().st_mtime for p in files), default=os.path.getmtime(root))
    family = str(config.get("model_type") or "unknown")
    details = OllamaModelDetails(
        format="gguf" if any(p.suffix == ".gguf" for p in files) else "safetensors",
        family=family, families=[family])
    modified_at = datetime.fromtimestamp(modified, timezone.utc).isoformat()
    return size, digest.hexdigest(), modified_at.replace("+00:00", "Z"), details


def _tagged(name: str) -> str:
    return name if ":" in name else name + _DEFAULT_TAG


def models_of(state: ServerState) -> list[OllamaModel]:
    size, digest, modified_at, details = model_facts(state.model_root)
    return [OllamaModel(name=_tagged(name), model=_tagged(name), modified_at=modified_at,
                        size=size, digest=digest, details=details)
            for name in state.served_model_names]
