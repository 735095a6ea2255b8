"""The Ollama model listings: /api/tags, /api/ps and /api/show describe the served model
from its own files: a GGUF's metadata and tensor table, or a checkpoint's config.json and
safetensors headers.

    GGUF file          format "gguf", size of the file, parameters = the tensors' elements,
                       quantization_level from general.file_type (e.g. MOSTLY_Q4_K_M ->
                       "Q4_K_M"), family = general.architecture, its context_length
    HF checkpoint      format "safetensors", size of the weight files, parameters from the
                       safetensors headers, quantization_level = the dtype ("BF16"), family
                       = model_type, max_position_embeddings
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from engine.model_loader.gguf import gguf_source
from engine.model_loader.gguf_file import GGUFFile
from server.apis.ollama.protocol import OllamaModel, OllamaModelDetails
from server.common.state import ServerState

_DEFAULT_TAG = ":latest"
_DTYPE_LEVELS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class ModelFacts:
    size: int  # bytes of the weights on disk
    digest: str
    modified_at: str
    details: OllamaModelDetails
    num_parameters: int
    context_length: int | None


def parameter_size(count: int) -> str:
    """Ollama's way of writing a parameter count: 134515008 -> "134.52M", 1.07e9 -> "1.1B"."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.1f}{unit}" if unit == "B" else f"{value:.2f}{unit}"
    return str(count)


def _file_type_name(file_type: Any) -> str:
    """general.file_type 15 -> "Q4_K_M"; "" when absent or unknown."""
    try:
        name = LlamaFileType(int(file_type)).name
    except (TypeError, ValueError):
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _gguf_facts(path: Path) -> tuple[list[Path], dict[str, Any]]:
    gguf = GGUFFile(path)
    arch = str(gguf.get("general.architecture") or "unknown")
    return [path], {
        "format": "gguf", "family": arch,
        "num_parameters": sum(math.prod(t.shape) for t in gguf.tensors.values()),
        "quantization_level": _file_type_name(gguf.get("general.file_type")),
        "context_length": gguf.get(f"{arch}.context_length"),
    }


def _safetensors_parameters(path: Path) -> int:
    """The element count of a .safetensors file, from its JSON header alone."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(math.prod(entry["shape"]) for name, entry in header.items()
               if name != "__metadata__")


def _checkpoint_facts(root: Path) -> tuple[list[Path], dict[str, Any]]:
    config: dict[str, Any] = {}
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        pass
    weights = sorted(root.glob("*.safetensors")) or sorted(root.glob("*.bin"))
    family = str(config.get("model_type") or "unknown")
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "")
    return weights, {
        "format": "safetensors", "family": family,
        "num_parameters": sum(_safetensors_parameters(p) for p in weights
                              if p.suffix == ".safetensors"),
        "quantization_level": _DTYPE_LEVELS.get(dtype, dtype.upper()),
        "context_length": config.get("max_position_embeddings"),
    }


@functools.lru_cache(maxsize=8)
def model_facts(model_root: str) -> ModelFacts:
    """What the listings say of the model whose checkpoint (or GGUF cache) dir is
    `model_root`. The digest is the SHA-256 of the weight files' names and sizes (an
    identity of the files, not a hash of the weights, which would take a while)."""
    root = Path(model_root)
    source = gguf_source(root)
    files, facts = _gguf_facts(source) if source is not None else _checkpoint_facts(root)
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    modified = max((p.stat().st_mtime for p in files), default=os.path.getmtime(root))
    details = OllamaModelDetails(
        format=facts["format"], family=facts["family"], families=[facts["family"]],
        parameter_size=parameter_size(facts["num_parameters"]),
        quantization_level=facts["quantization_level"])
    modified_at = datetime.fromtimestamp(modified, timezone.utc).isoformat()
    return ModelFacts(
        size=sum(p.stat().st_size for p in files), digest=digest.hexdigest(),
        modified_at=modified_at.replace("+00:00", "Z"), details=details,
        num_parameters=facts["num_parameters"], context_length=facts["context_length"])


def _tagged(name: str) -> str:
    return name if ":" in name else name + _DEFAULT_TAG


def models_of(state: ServerState) -> list[OllamaModel]:
    facts = model_facts(state.model_root)
    return [OllamaModel(name=_tagged(name), model=_tagged(name), modified_at=facts.modified_at,
                        size=facts.size, digest=facts.digest, details=facts.details)
            for name in state.served_model_names]
