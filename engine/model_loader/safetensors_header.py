"""A safetensors file's header alone, without torch (the HTTP frontend reads it): 8 bytes
of little-endian length, then that much JSON naming every tensor's dtype, shape and
offsets."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20


def read_header(path: str | Path) -> dict[str, Any]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} (the `__metadata__` entry left out).

    Raises ValueError for a file that is not safetensors, OSError if it cannot be read.
    """
    with open(path, "rb") as f:
        try:
            (length,) = struct.unpack("<Q", f.read(8))
        except struct.error:
            raise ValueError("shorter than a safetensors header") from None
        if length > MAX_HEADER_BYTES:
            raise ValueError("header too large")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header


def checkpoint_tensor_names(model_dir: str | Path) -> list[str]:
    """Every tensor name of a checkpoint directory's safetensors files (its index's, when
    sharded); [] when it has none."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    names: list[str] = []
    for path in sorted(model_dir.glob("*.safetensors")):
        names.extend(read_header(path))
    return names
