"""The scheduler's image work: encoder budget, encoder cache, image-keyed block hashes."""

from __future__ import annotations

from engine.multimodal.inputs import ImageFeature
from engine.request import RequestStatus
from engine.sched.encoder_cache import EncoderCacheManager
from tests.support.scheduler import (
    BLOCK_SIZE,
    add,
    assert_all_blocks_free,
    make_scheduler,
    run_to_completion,
    step,
)


def image(identifier: str, offset: int, length: int, num_markers: int = 0) -> ImageFeature:
    """An image run of `length` positions at `offset`; its first `num_markers` are marker
    tokens (no encoder row)."""
    is_embed = None if not num_markers else [0] * num_markers + [1] * (length - num_markers)
    return ImageFeature(identifier, offset, length, is_embed, tensors={})


def prompt_with_images(num_tokens: int, features: list[ImageFeature], base: int = 500) -> list[int]:
    """Distinct text tokens, the placeholder id 7 at image positions."""
    tokens = list(range(base, base + num_tokens))
    for feature in features:
        tokens[feature.offset:feature.end] = [7] * feature.length
    return tokens


def encoded(output) -> list[str]:
    return [f.identifier for f in output.scheduled_encoder_inputs]


def test_an_image_is_encoded_once_for_every_chunk_that_cuts_through_it():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    x = image("x", 10, 12)  # positions 10..21; chunks of 16 cut it at 16
    add(scheduler, "a", prompt_with_images(30, [x]), mm_features=[x])
    first, _ = step(scheduler)
    assert first.num_scheduled_tokens == {"a": 16} and encoded(first) == ["x"]
    second, _ = step(scheduler)
    assert second.num_scheduled_tokens == {"a": 14} and encoded(second) == []
    run_to_completion(scheduler, sample=lambda r: 3, max_steps=300)
    assert_all_blocks_free(scheduler)


def test_a_step_stops_before_an_image_the_encoder_budget_cannot_take():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=16)
    x, y = image("x", 4, 10), image("y", 20, 10)  # 10 + 10 rows > 16
    add(scheduler, "a", prompt_with_images(40, [x, y]), mm_features=[x, y])
    first, _ = step(scheduler)
    assert encoded(first) == ["x"] and first.num_scheduled_tokens == {"a": 20}
    second, _ = step(scheduler)
    assert encoded(second) == ["y"] and second.num_scheduled_tokens == {"a": 20}


def test_an_image_larger_than_the_budget_runs_alone():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_encoder_input_tokens=8,
                               encoder_cache_size=8)
    x = image("x", 2, 20)
    add(scheduler, "a", prompt_with_images(30, [x]), mm_features=[x])
    first, _ = step(scheduler)
    assert encoded(first) == ["x"] and first.num_scheduled_tokens == {"a": 30}


def test_marker_tokens_take_no_encoder_rows():
    assert image("x", 0, 12, num_markers=2).num_embeds == 10
    assert image("x", 0, 12).num_embeds == 12


def test_the_same_image_in_two_requests_is_encoded_once_and_text_differs_in_kv():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    x = image("x", 4, 8)
    add(scheduler, "a", prompt_with_images(20, [x], base=500), mm_features=[x])
    add(scheduler, "b", prompt_with_images(20, [x], base=900), mm_features=[x])
    first, _ = step(scheduler)
    assert encoded(first) == ["x"]  # b reads what a's step encodes
    assert set(first.num_scheduled_tokens) == {"a", "b"}
    run_to_completion(scheduler, sample=lambda r: 3, max_steps=300)
    # Both finished: x is kept, freeable, until its room is needed.
    assert scheduler.encoder_cache.holds("x")
    add(scheduler, "c", prompt_with_images(24, [x], base=1300), mm_features=[x])
    third, _ = step(scheduler)
    assert encoded(third) == []  # revived from the freeable entries


def test_block_hashes_cover_the_images_in_each_block():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    x, y = image("x", 4, 8), image("y", 4, 8)
    tokens = prompt_with_images(20, [x])
    a = add(scheduler, "a", tokens, mm_features=[x])
    b = add(scheduler, "b", tokens, mm_features=[y])
    c = add(scheduler, "c", tokens, mm_features=[image("x", 4, 8)])
    # Block 0 (positions 0..3) holds no image: shared; blocks 1, 2 hold the image.
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1] != b.block_hashes[1] and a.block_hashes[2] != b.block_hashes[2]
    assert a.block_hashes == c.block_hashes
    assert a.block_extra_keys(1) == ("x",) and a.block_extra_keys(3) is None
    assert BLOCK_SIZE == 4


def test_same_image_and_text_hit_the_prefix_cache_and_skip_the_encoder():
    scheduler = make_scheduler(max_num_batched_tokens=64, encoder_cache_size=8)
    x = image("x", 4, 8)
    tokens = prompt_with_images(21, [x])
    add(scheduler, "a", tokens, mm_features=[x])
    run_to_completion(scheduler, sample=lambda r: 3, max_steps=300)
    # Evict x from the encoder cache: another image needs the room.
    z = image("z", 0, 8)
    add(scheduler, "z", prompt_with_images(10, [z], base=3000), mm_features=[z])
    out, _ = step(scheduler)
    assert encoded(out) == ["z"] and "x" in out.free_encoder_ids
    run_to_completion(scheduler, sample=lambda r: 3, max_steps=300)
    add(scheduler, "b", tokens, mm_features=[image("x", 4, 8)])
    out, _ = step(scheduler)
    # Blocks 0..4 (20 tokens) are cached, image included: only token 20 is computed.
    assert out.num_scheduled_tokens == {"b": 1} and encoded(out) == []
    y = image("y", 4, 8)
    add(scheduler, "c", tokens, mm_features=[y])
    out, _ = step(scheduler)
    # Another image: only block 0 is shared, y must be encoded.
    assert out.num_scheduled_tokens["c"] == 17 and encoded(out) == ["y"]


def test_preempted_and_aborted_requests_release_their_images():
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=64)
    x = image("x", 2, 8)
    add(scheduler, "a", prompt_with_images(20, [x]), mm_features=[x], max_tokens=40)
    add(scheduler, "b", prompt_with_images(20, [image("y", 2, 8)], base=800),
        mm_features=[image("y", 2, 8)], max_tokens=40)
    step(scheduler)
    for _ in range(20):  # the KV cache fills up: b is preempted
        step(scheduler, sample=lambda r: 3)
    assert scheduler.requests["b"].num_preemptions > 0
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    assert_all_blocks_free(scheduler)
    assert scheduler.encoder_cache.num_in_use == 0  # nobody holds an image


def test_encoder_cache_evicts_oldest_freeable_and_never_a_kept_one():
    cache = EncoderCacheManager(capacity=10)
    cache.allocate("a", 4, "r1")
    cache.allocate("b", 4, "r2")
    cache.release("a", "r1")
    cache.release("b", "r2")
    assert cache.make_room(6, keep=["a"])  # b goes, a is kept
    assert cache.take_evicted() == ["b"] and cache.holds("a") and not cache.holds("b")
    cache.add_user("a", "r3")
    cache.allocate("c", 6, "r4")
    assert not cache.make_room(1)  # everything in use
    assert cache.take_evicted() == []


def test_a_bidirectional_image_is_never_split_across_steps():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    x = image("x", 6, 12, num_markers=1)  # soft tokens at 7..17
    x.bidirectional = True
    add(scheduler, "a", prompt_with_images(30, [x]), mm_features=[x])
    first, _ = step(scheduler)
    assert first.num_scheduled_tokens == {"a": 7}  # stops before the soft tokens
    assert encoded(first) == ["x"]  # its run (the marker at 6) has begun
    second, _ = step(scheduler)
    assert second.num_scheduled_tokens == {"a": 16} and encoded(second) == []


def test_a_bidirectional_image_longer_than_a_step_is_refused():
    import pytest

    scheduler = make_scheduler(max_num_batched_tokens=16)
    x = image("x", 2, 20)
    x.bidirectional = True
    with pytest.raises(ValueError, match="one step"):
        add(scheduler, "a", prompt_with_images(30, [x]), mm_features=[x])
