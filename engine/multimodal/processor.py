"""A vision-language model's prompt processor: a rendered prompt with one placeholder per
image, and the images, in; the prompt's token ids and one `ImageFeature` per image out.

    "User:<image>What is this?<end_of_utterance>\\nAssistant:"  + [image]
      each image alone through the checkpoint's own processor (transformers'), which
      resizes and splits it and expands the placeholder into its run of marker and soft
      tokens:  <fake><row_1_col_1><image>*64 ... <fake><global-img><image>*64<fake>
      the prompt with each placeholder replaced by its run's text, tokenized whole
      ImageFeature(offset = the image's first soft token, length = to its last,
                   is_embed = which of those are soft tokens, tensors = pixel_values, ...)

Each image goes through the processor alone, so its tensors are its own (no padding to
the largest image of the prompt); the whole prompt is tokenized at once, as the
processor would, so tokens at a run's edges merge with the text as they do there. The
processor runs in the HTTP frontend with transformers' PIL image processors (no torch,
no torchvision). An image already processed is served from a bounded cache keyed by its
content hash (`ProcessedImageCache`, `--mm-processor-cache-gb` as vLLM spells it): a
repeated image costs no resize or split.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.model_loader.safetensors_header import checkpoint_tensor_names
from engine.multimodal.inputs import ImageFeature, TensorData

# Models whose processor expands another token than `image_token` (what their chat
# templates write for one image), and models whose image tokens attend both ways.
_PLACEHOLDER_ATTRIBUTE = {"gemma3": "boi_token"}
_BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})
_CROP_LEADING_OUTPUTS = frozenset({"gemma3"})

# vLLM's --mm-processor-cache-gb is 4 GiB; a SmolVLM image of 13 tiles is ~41 MB of float32.
DEFAULT_CACHE_BYTES = 1 << 30

# Keys of a processor's output that are the text's, not the image's.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class ImageLike(Protocol):
    """A decoded image (server/common/images.py LoadedImage): RGB pixels and their hash."""

    image: Any  # PIL.Image.Image
    content_hash: str


def _has_vision_tower(model_dir: str | Path) -> bool:
    """Whether the checkpoint's tensors include a vision tower (read from the safetensors
    headers; a directory of other weight files is given the benefit of the doubt)."""
    try:
        names = checkpoint_tensor_names(model_dir)
    except (OSError, ValueError):
        return True
    return not names or any("vision" in name for name in names)


@dataclass
class ProcessedImage:
    """One image through the processor: its placeholder run's token ids and its tensors."""

    run: np.ndarray
    tensors: dict[str, TensorData]

    @property
    def nbytes(self) -> int:
        return self.run.nbytes + sum(len(t.data) for t in self.tensors.values())


class ProcessedImageCache:
    """Least-recently-used processed images by content hash, at most `capacity_bytes` of
    tensors in all (0: caches nothing). Thread-safe: requests process in worker threads.

    capacity 100 MB, images of 40 MB: a, b cached (80); c evicts a (the least recently
    used) -> b, c; a hit on b makes c the next to go.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> ProcessedImage | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: str, entry: ProcessedImage) -> None:
        size = entry.nbytes
        with self._lock:
            if size > self.capacity_bytes or key in self._entries:
                return
            while self.used_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.used_bytes -= evicted.nbytes
            self._entries[key] = entry
            self.used_bytes += size


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    features: list[ImageFeature]


class ImagePromptProcessor:
    """The checkpoint's processor, one image at a time (see the module doc)."""

    def __init__(self, hf_processor: Any, image_token_id: int, placeholder: str,
                 bidirectional: bool = False, batched_outputs: bool = True,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self.hf_processor = hf_processor
        self.tokenizer = hf_processor.tokenizer
        self.image_token_id = image_token_id
        self.placeholder = placeholder  # what a chat template writes for one image
        self.bidirectional = bidirectional  # the model's image tokens attend both ways
        # Its processor's image tensors lead with the prompt batch (SmolVLM: [1, tiles, ...]);
        # others lead with the image's crops (Gemma 3: [crops, 3, H, W]).
        self.batched_outputs = batched_outputs
        self.cache = ProcessedImageCache(cache_bytes)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any,
                        cache_bytes: int = DEFAULT_CACHE_BYTES) -> ImagePromptProcessor | None:
        """The processor of a vision-language checkpoint; None for a text-only model (its
        config names no image token) or a directory without processor files."""
        image_token_id = getattr(hf_config, "image_token_id", None)
        if image_token_id is None or not Path(model_dir).is_dir():
            return None
        from transformers import AutoProcessor

        try:
            hf_processor = AutoProcessor.from_pretrained(str(model_dir))
        except (OSError, ValueError):
            return None
        model_type = getattr(hf_config, "model_type", "")
        placeholder = getattr(hf_processor,
                              _PLACEHOLDER_ATTRIBUTE.get(model_type, "image_token"), None)
        if not placeholder or not hasattr(hf_processor, "image_processor"):
            return None
        return cls(hf_processor, int(image_token_id), str(placeholder),
                   bidirectional=model_type in _BIDIRECTIONAL_IMAGES,
                   batched_outputs=model_type not in _CROP_LEADING_OUTPUTS,
                   cache_bytes=cache_bytes)

    @classmethod
    def for_model(cls, model_dir: str | Path,
                  cache_bytes: int = DEFAULT_CACHE_BYTES) -> ImagePromptProcessor | None:
        """`from_pretrained` with the checkpoint's own config; None when it is not a local
        vision-language checkpoint (a GGUF file; a multimodal config whose checkpoint
        holds no vision tower: the model then serves text only)."""
        if not Path(model_dir).is_dir() or not (Path(model_dir) / "config.json").exists():
            return None
        from transformers import AutoConfig

        processor = cls.from_pretrained(model_dir, AutoConfig.from_pretrained(str(model_dir)),
                                        cache_bytes)
        if processor is not None and not _has_vision_tower(model_dir):
            return None
        return processor

    def process(self, prompt: str, images: Sequence[ImageLike]) -> ProcessedPrompt:
        """Token ids of `prompt` with each placeholder expanded for its image, in order.

        Raises ValueError when the placeholders and the images differ in number, or when
        the text itself holds the model's image tokens.
        """
        pieces = prompt.split(self.placeholder)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders "
                             f"({self.placeholder!r}) for {len(images)} images")
        expanded = [self._expand_cached(image) for image in images]
        # The whole prompt tokenized at once, as the processor itself would: a run's first
        # or last token may merge with the text beside it (Gemma 3's "\n\n").
        text = pieces[0] + "".join(
            self.tokenizer.decode(run.tolist(), skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False) + piece
            for (run, _), piece in zip(expanded, pieces[1:], strict=True))
        token_ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        # Worked example: embed positions [5, 6, 9, 10, 20, 21], images of 4 and 2 rows ->
        # image 0 takes 5, 6, 9, 10 (offset 5, length 6, is_embed 1 1 0 0 1 1), image 1
        # takes 20, 21 (offset 20, length 2, every position).
        positions = np.flatnonzero(np.asarray(token_ids) == self.image_token_id)
        counts = [int((run == self.image_token_id).sum()) for run, _ in expanded]
        if len(positions) != sum(counts):
            raise ValueError(f"the prompt holds {len(positions) - sum(counts):+d} image tokens "
                             "beside its images' own")
        features = []
        start = 0
        for image, (_, tensors), count in zip(images, expanded, counts, strict=True):
            own = positions[start:start + count]
            start += count
            offset, length = int(own[0]), int(own[-1] - own[0] + 1)
            is_embed = np.zeros(length, dtype=np.int8)
            is_embed[own - offset] = 1
            features.append(ImageFeature(
                identifier=image.content_hash, offset=offset, length=length,
                is_embed=None if is_embed.all() else is_embed.tolist(), tensors=tensors,
                bidirectional=self.bidirectional))
        return ProcessedPrompt(token_ids, features)

    def _expand_cached(self, image: ImageLike) -> tuple[np.ndarray, dict[str, TensorData]]:
        """`_expand`, or the cache's entry for an image of the same pixels."""
        entry = self.cache.get(image.content_hash)
        if entry is None:
            entry = ProcessedImage(*self._expand(image.image))
            self.cache.put(image.content_hash, entry)
        return entry.run, entry.tensors

    def _expand(self, image: Any) -> tuple[np.ndarray, dict[str, TensorData]]:
        """One image through the processor: its placeholder run's token ids and its
        tensors (the processor's; a per-prompt batch dimension of 1 dropped)."""
        out = self.hf_processor(text=[self.placeholder], images=[[image]],
                                return_tensors="np", add_special_tokens=False)
        run = np.asarray(out["input_ids"][0], dtype=np.int64)
        tensors = {}
        for name, value in out.items():
            if name in _TEXT_KEYS:
                continue
            array = np.asarray(value)
            if self.batched_outputs:
                array = array[0]
            if name.endswith("mask"):
                array = array.astype(bool)  # 1 byte a pixel on the wire, not 8
            tensors[name] = TensorData.from_array(array)
        return run, tensors
