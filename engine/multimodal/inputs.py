"""What a request with images carries to the engine core: one `ImageFeature` per image.

The frontend expands each image into the model's placeholder tokens (the model's
processor decides how many: a SmolVLM image split into a 2 x 2 grid plus its global view
is 5 tiles x 64 soft tokens, framed by row/column marker tokens). The feature says where
that run sits in the prompt and which of its positions take an encoder output row:

    prompt   ... User: <fake> <row_1_col_1> <img> <img> <fake> <row_1_col_2> <img> <img> ...
    offset   ----------------^ (the first position of the run)
    is_embed                  0     1     1     0       0         1     1   ...

`num_embeds` (the 1s) is the number of rows the vision tower + projector produce for
the image, in order; `identifier` is the content hash of the decoded pixels, which keys
the encoder cache and enters the hash of every KV block the run touches
(engine/request.py `block_extra_keys`), so the same text with another image never
shares KV past the image, and the same image + text does.

Everything here travels over the frontend -> core socket as msgpack (engine/ipc.py):
tensors as `TensorData` (dtype, shape, raw bytes), never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TensorData:
    """An array on the wire: numpy dtype name, shape and its C-order bytes."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_array(cls, array: np.ndarray) -> TensorData:
        array = np.ascontiguousarray(array)
        return cls(array.dtype.name, list(array.shape), array.tobytes())

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


@dataclass
class ImageFeature:
    """One image of a prompt: its placeholder run, its pixels, its content hash."""

    identifier: str  # content hash (hex) of the decoded pixels: the encoder cache key
    offset: int  # first prompt position of the image's placeholder run
    length: int  # positions in the run (marker tokens included)
    # Per position of the run, 1 where an encoder output row goes; None: every position.
    is_embed: list[int] | None
    # The model processor's outputs for this image, by name (e.g. "pixel_values"
    # [tiles, 3, H, W] float32, "pixel_attention_mask" [tiles, H, W] bool).
    tensors: dict[str, TensorData]
    # Its soft tokens attend to each other both ways (Gemma 3): the scheduler computes
    # them in one step, the attention ORs their block into the causal mask.
    bidirectional: bool = False

    @property
    def end(self) -> int:
        """One past the run's last position."""
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Encoder output rows the image takes (its cost in the encoder budget)."""
        return self.length if self.is_embed is None else int(sum(self.is_embed))

    def embed_span(self) -> tuple[int, int]:
        """[first, end) prompt positions from the first to the last embedding row's."""
        rows = np.flatnonzero(self.embed_mask())
        return self.offset + int(rows[0]), self.offset + int(rows[-1]) + 1

    def embed_mask(self) -> np.ndarray:
        """is_embed as a bool array of `length`."""
        if self.is_embed is None:
            return np.ones(self.length, dtype=bool)
        return np.asarray(self.is_embed, dtype=bool)


def image_content_hash(image) -> str:
    """Hex sha256 of a decoded image's mode, size and pixels (a PIL image): the same
    pixels give the same hash whatever file they came in; one pixel changed, another."""
    import hashlib

    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
