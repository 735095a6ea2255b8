"""A small GGUF reader: metadata, tensor index, and dequantized tensors on demand.

`gguf.GGUFReader` builds numpy views for every metadata item, which takes
seconds on a 49k-token vocabulary; this parses the header with `struct` in a
fraction of that and leaves tensor data memory-mapped until asked for.

File layout (little-endian, GGUF v2/v3):

    "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x  (key: string, value_type u32, value)
    tensor_count x  (name: string, n_dims u32, ne[n_dims] u64, ggml_type u32, offset u64)
    padding to `general.alignment` (32) | tensor data (offsets are relative to here)

A string is (length u64, utf-8 bytes); an array is (elem_type u32, count u64, elems).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

# value type -> (struct format, size) for scalars
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_KNOWN_TYPES = {t.value for t in GGMLQuantizationType}


class UnsupportedGGUFError(ValueError):
    """Not a GGUF file, or one using a version, architecture, tensor or type we cannot read."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGML's ne reversed): [rows, ..., ne0]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    """metadata: key -> value (str, number, bool, or list); tensors: name -> GGUFTensorInfo."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._data)
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise UnsupportedGGUFError(f"{self.path} is not a GGUF file")
        self._pos = 4
        try:
            self._parse_header()
        except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError) as exc:
            if isinstance(exc, UnsupportedGGUFError):
                raise
            raise UnsupportedGGUFError(f"{self.path.name} is truncated or corrupt: its header "
                                       f"does not parse ({type(exc).__name__})") from None

    def _parse_header(self) -> None:
        version = self._scalar(4)
        if version not in (2, 3):
            raise UnsupportedGGUFError(f"unsupported GGUF version {version} (2 and 3 are)")
        tensor_count, kv_count = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        raw_infos = []
        for _ in range(tensor_count):
            name = self._string()
            ne = [self._scalar(10) for _ in range(self._scalar(4))]
            type_id = self._scalar(4)
            if type_id not in _KNOWN_TYPES:
                raise UnsupportedGGUFError(f"tensor {name!r} has unknown GGML type {type_id}")
            raw_infos.append((name, ne, GGMLQuantizationType(type_id), self._scalar(10)))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, ne, ggml_type, offset in raw_infos:
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            if ne[0] % block_size:
                raise UnsupportedGGUFError(f"tensor {name!r}: row length {ne[0]} is not a "
                                           f"multiple of {ggml_type.name}'s block ({block_size})")
            num_bytes = math.prod(ne) // block_size * type_size
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(ne)), ggml_type,
                                                data_start + offset, num_bytes)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, memory-mapped (read-only): uint8 [rows, row_bytes]."""
        info = self.tensors[name]
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        return self._data[info.offset : info.offset + info.num_bytes].reshape(rows, -1)

    def read(self, name: str) -> np.ndarray:
        """The tensor's bytes read from the file into memory (not mapped): uint8 [rows, row_bytes]."""
        info = self.tensors[name]
        rows = math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1
        data = np.fromfile(self.path, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
        return data.reshape(rows, -1)

    def load(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy (= PyTorch) shape."""
        info = self.tensors[name]
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        *rows, ne0 = info.shape
        raw = self._data[info.offset : info.offset + info.num_bytes]
        raw = raw.reshape(*rows, ne0 // block_size * type_size)
        try:
            values = dequantize(raw, info.ggml_type).astype(np.float32, copy=False)
        except NotImplementedError:
            raise UnsupportedGGUFError(f"tensor {name!r}: cannot dequantize "
                                       f"{info.ggml_type.name}") from None
        if not values.flags.writeable:  # F32 tensors come back as views of the mapped file
            values = values.copy()
        return values.reshape(info.shape)

    # -- header parsing ---------------------------------------------------------------------

    def _scalar(self, value_type: int):
        fmt, size = _SCALARS[value_type]
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        length = self._scalar(10)
        start, self._pos = self._pos, self._pos + length
        return bytes(self._buf[start : self._pos]).decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            return self._scalar(value_type)
        elem_type, count = self._scalar(4), self._scalar(10)
        if elem_type in _NUMPY:  # numeric arrays in one go
            dtype = np.dtype(_NUMPY[elem_type])
            values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return values.tolist()
        return [self._value(elem_type) for _ in range(count)]
