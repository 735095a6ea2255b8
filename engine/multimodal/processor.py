"""A vision-language model's prompt processor: a rendered prompt with one placeholder per
image, and the images, in; the prompt's token ids and one `ImageFeature` per image out.

    "User:<image>What is this?<end_of_utterance>\\nAssistant:"  + [image]
      split at the placeholder:  ["User:", "What is this?<end_of_utterance>\\nAssistant:"]
      each image alone through the checkpoint's own processor (transformers'), which
      resizes and splits it and expands the placeholder into its run of marker and soft
      tokens:  <fake><row_1_col_1><image>*64 ... <fake><global-img><image>*64<fake>
      token ids = tokens("User:") + run + tokens("What is ...")
      ImageFeature(offset = len(tokens("User:")), length = len(run),
                   is_embed = run == image_token_id, tensors = pixel_values, ...)

Each image goes through the processor alone, so its tensors are its own (no padding to
the largest image of the prompt) and its run is exactly what the processor writes for
it; the runs begin and end with special tokens, so tokenizing the text between them
apart gives the tokens the whole prompt would. The processor runs in the HTTP frontend
with transformers' PIL image processors (no torch, no torchvision).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.multimodal.inputs import ImageFeature, TensorData

# Models whose processor expands another token than `image_token` (what their chat
# templates write for one image), and models whose image tokens attend both ways.
_PLACEHOLDER_ATTRIBUTE = {"gemma3": "boi_token"}
_BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})

# Keys of a processor's output that are the text's, not the image's.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class ImageLike(Protocol):
    """A decoded image (server/common/images.py LoadedImage): RGB pixels and their hash."""

    image: Any  # PIL.Image.Image
    content_hash: str


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    features: list[ImageFeature]


class ImagePromptProcessor:
    """The checkpoint's processor, one image at a time (see the module doc)."""

    def __init__(self, hf_processor: Any, image_token_id: int, placeholder: str,
                 bidirectional: bool = False):
        self.hf_processor = hf_processor
        self.tokenizer = hf_processor.tokenizer
        self.image_token_id = image_token_id
        self.placeholder = placeholder  # what a chat template writes for one image
        self.bidirectional = bidirectional  # the model's image tokens attend both ways

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, hf_config: Any) -> ImagePromptProcessor | None:
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
                   bidirectional=model_type in _BIDIRECTIONAL_IMAGES)

    @classmethod
    def for_model(cls, model_dir: str | Path) -> ImagePromptProcessor | None:
        """`from_pretrained` with the checkpoint's own config (None: not a local
        vision-language checkpoint, e.g. a GGUF file)."""
        if not Path(model_dir).is_dir() or not (Path(model_dir) / "config.json").exists():
            return None
        from transformers import AutoConfig

        return cls.from_pretrained(model_dir, AutoConfig.from_pretrained(str(model_dir)))

    def process(self, prompt: str, images: Sequence[ImageLike]) -> ProcessedPrompt:
        """Token ids of `prompt` with each placeholder expanded for its image, in order.

        Raises ValueError when the placeholders and the images differ in number.
        """
        pieces = prompt.split(self.placeholder)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"the prompt has {len(pieces) - 1} image placeholders "
                             f"({self.placeholder!r}) for {len(images)} images")
        token_ids: list[int] = []
        features: list[ImageFeature] = []
        for index, piece in enumerate(pieces):
            if piece:
                token_ids.extend(self.tokenizer(piece, add_special_tokens=False).input_ids)
            if index == len(images):
                break
            run, tensors = self._expand(images[index].image)
            is_embed = (run == self.image_token_id).astype(np.int8)
            features.append(ImageFeature(
                identifier=images[index].content_hash, offset=len(token_ids), length=len(run),
                is_embed=None if is_embed.all() else is_embed.tolist(), tensors=tensors,
                bidirectional=self.bidirectional))
            token_ids.extend(run.tolist())
        return ProcessedPrompt(token_ids, features)

    def _expand(self, image: Any) -> tuple[np.ndarray, dict[str, TensorData]]:
        """One image through the processor: its placeholder run's token ids and its
        tensors (the processor's, without their batch dimension of 1)."""
        out = self.hf_processor(text=[self.placeholder], images=[[image]],
                                return_tensors="np", add_special_tokens=False)
        run = np.asarray(out["input_ids"][0], dtype=np.int64)
        tensors = {}
        for name, value in out.items():
            if name in _TEXT_KEYS:
                continue
            array = np.asarray(value)[0]
            if name.endswith("mask"):
                array = array.astype(bool)  # 1 byte a pixel on the wire, not 8
            tensors[name] = TensorData.from_array(array)
        return run, tensors
