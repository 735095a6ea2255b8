"""The frontend's cache of processed images (engine/multimodal/processor.py): a repeated
image is not resized and split again, and its prompt is the same as processed afresh."""

from __future__ import annotations

import numpy as np
import pytest

from engine.multimodal.inputs import TensorData, image_content_hash
from engine.multimodal.processor import ImagePromptProcessor, ProcessedImage, ProcessedImageCache
from tests.support.vlm_fixtures import build_tiny_idefics3_checkpoint, sample_images


def entry(num_bytes: int) -> ProcessedImage:
    return ProcessedImage(np.zeros(0, dtype=np.int64),
                          {"pixel_values": TensorData("uint8", [num_bytes], b"\0" * num_bytes)})


def test_lru_evicts_the_least_recently_used_within_capacity():
    cache = ProcessedImageCache(capacity_bytes=100)
    cache.put("a", entry(40))
    cache.put("b", entry(40))
    assert cache.used_bytes == 80
    cache.put("c", entry(40))  # a goes
    assert cache.get("a") is None and cache.get("b") is not None
    cache.put("d", entry(40))  # b was used last, so c goes
    assert cache.get("c") is None
    assert cache.get("b") is not None and cache.get("d") is not None
    assert cache.used_bytes == 80 and len(cache) == 2
    cache.put("huge", entry(101))  # larger than the whole cache: not kept, nothing evicted
    assert cache.get("huge") is None and len(cache) == 2
    assert (cache.hits, cache.misses) == (3, 3)


def test_zero_capacity_keeps_nothing():
    cache = ProcessedImageCache(capacity_bytes=0)
    cache.put("a", entry(1))
    assert cache.get("a") is None and cache.used_bytes == 0


class Loaded:
    def __init__(self, image):
        self.image, self.content_hash = image, image_content_hash(image)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_idefics3_checkpoint(tmp_path_factory.mktemp("vlm"))


@pytest.mark.parametrize("cache_bytes", [1 << 30, 0])
def test_a_repeated_image_is_processed_once(checkpoint, cache_bytes):
    processor = ImagePromptProcessor.for_model(checkpoint, cache_bytes)
    calls = []
    inner = processor.hf_processor

    def counting(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    processor.hf_processor = counting
    image, other = sample_images()[0], sample_images()[2]
    prompt = f"User:{processor.placeholder}What is this?{processor.placeholder}Assistant:"
    first = processor.process(prompt, [Loaded(image), Loaded(other)])
    again = processor.process(prompt, [Loaded(image.copy()), Loaded(other)])
    assert len(calls) == (2 if cache_bytes else 4)
    assert again.token_ids == first.token_ids
    for a, b in zip(first.features, again.features, strict=True):
        assert (a.identifier, a.offset, a.length, a.is_embed) == \
            (b.identifier, b.offset, b.length, b.is_embed)
        assert {k: (v.dtype, v.shape, v.data) for k, v in a.tensors.items()} == \
            {k: (v.dtype, v.shape, v.data) for k, v in b.tensors.items()}
