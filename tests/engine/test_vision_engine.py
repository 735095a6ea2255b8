"""Images through the whole engine (scheduler, encoder cache, paged KV, prefix cache) on a
tiny random Idefics3 checkpoint: greedy tokens equal transformers' `generate` given the
same token ids and pixels, alone, several images per prompt, batched, under chunked
prefill that cuts through images, prefix-cache hits and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from tests.support.correctness import count_preemptions
from tests.support.hf_reference import TOP_K_FOR_TIES, Reference, assert_greedy_matches
from tests.support.vlm_fixtures import build_tiny_idefics3_checkpoint, sample_images

NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def chat_prompt(question: str, num_images: int) -> str:
    """The tiny checkpoint's SmolVLM template, rendered: images first, then the question."""
    return f"<|im_start|>User:{'<image>' * num_images}{question}<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_idefics3_checkpoint(tmp_path_factory.mktemp("vlm"))


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import Idefics3ForConditionalGeneration

    return Idefics3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


def processed(llm: LLM, prompt: str, images):
    images = images if isinstance(images, list) else [images]
    return llm._image_processor().process(prompt, [_Image(image) for image in images])


class _Image:
    def __init__(self, image):
        from engine.multimodal.inputs import image_content_hash

        self.image, self.content_hash = image, image_content_hash(image)


def hf_reference(hf_model, llm: LLM, prompts: list[dict]) -> Reference:
    """transformers' greedy tokens for our token ids and each image's own pixels."""
    ref = Reference([], [], [])
    for prompt in prompts:
        out = processed(llm, prompt["prompt"], prompt["multi_modal_data"]["image"])
        kwargs = {}
        if out.features:
            for name in ("pixel_values", "pixel_attention_mask"):
                kwargs[name] = torch.from_numpy(np.concatenate(
                    [f.tensors[name].to_array() for f in out.features]))[None]
        with torch.inference_mode():
            gen = hf_model.generate(torch.tensor([out.token_ids]), do_sample=False,
                                    max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                                    output_logits=True, return_dict_in_generate=True,
                                    pad_token_id=0, **kwargs)
        logits = torch.cat(gen.logits).float()
        ref.token_ids.append(gen.sequences[0, len(out.token_ids):].tolist())
        ref.top5.append(logits.topk(TOP_K_FOR_TIES, dim=-1).indices.tolist())
        ref.logprobs.append(torch.log_softmax(logits, dim=-1))
    return ref


def image_prompts() -> list[dict]:
    a, b, c = sample_images()
    return [
        {"prompt": chat_prompt("What is this?", 1), "multi_modal_data": {"image": a}},
        {"prompt": chat_prompt("Compare them.", 2), "multi_modal_data": {"image": [b, c]}},
        {"prompt": chat_prompt("And this one?", 1), "multi_modal_data": {"image": c}},
    ]


def generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def encoder_runner(llm: LLM):
    return llm.engine_core.executor.runner.encoder_runner


def test_images_alone_and_batched_match_transformers(checkpoint, hf_model):
    with LLM(str(checkpoint), dtype="float32", max_model_len=512) as llm:
        prompts = image_prompts()
        ref = hf_reference(hf_model, llm, prompts)
        alone = [generate(llm, [p])[0] for p in prompts]
        assert llm.engine_core.reset_prefix_cache()
        batched = generate(llm, prompts)
        assert_greedy_matches(alone, ref)
        assert_greedy_matches(batched, ref)


def test_chunked_prefill_through_images_prefix_hits_and_preemption(checkpoint, hf_model):
    # 16-token steps cut every image run (20-34 positions); the KV cache (10 blocks of 16
    # tokens) cannot hold three 60-100-token prompts and their outputs: one is preempted;
    # the encoder cache (40 rows) holds two images at most, so images are evicted.
    with LLM(str(checkpoint), dtype="float32", max_model_len=512, max_num_batched_tokens=16,
             num_gpu_blocks_override=10, block_size=16, encoder_cache_size=40) as llm:
        prompts = image_prompts()
        ref = hf_reference(hf_model, llm, prompts)
        preemptions = count_preemptions(llm)
        first = generate(llm, prompts)
        assert_greedy_matches(first, ref)
        assert preemptions[0] > 0
        # Again: the prefix cache now holds the prompts (images included).
        again = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_greedy_matches([o.outputs[0].token_ids for o in again], ref)
        assert any(o.num_cached_tokens > 0 for o in again)


def test_another_image_gives_another_answer_and_shares_no_block_past_it(checkpoint):
    a, b, _ = sample_images()
    with LLM(str(checkpoint), dtype="float32", max_model_len=512, block_size=16) as llm:
        prompt = chat_prompt("Describe it in detail please.", 1)
        first = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": a}}], GREEDY,
                             use_tqdm=False)[0]
        other = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": b}}], GREEDY,
                             use_tqdm=False)[0]
        same = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": a}}], GREEDY,
                            use_tqdm=False)[0]
        image_offset = processed(llm, prompt, [a]).features[0].offset
        assert other.outputs[0].token_ids != first.outputs[0].token_ids
        # Only the blocks wholly before the image are shared with another image.
        assert other.num_cached_tokens == image_offset // 16 * 16
        assert same.num_cached_tokens > image_offset
        assert same.outputs[0].token_ids == first.outputs[0].token_ids
        # a encoded once, b once: the third request read its KV from the prefix cache.
        assert encoder_runner(llm).num_encoded == 2


def test_the_xray_shows_images_and_the_encoder_cache(checkpoint):
    from engine.xray_schema import XrayLimits

    with LLM(str(checkpoint), dtype="float32", max_model_len=512, max_num_batched_tokens=16,
             encoder_cache_size=64) as llm:
        prompt = image_prompts()[1]  # two images
        processed_request = llm._process(prompt, GREEDY, None, None)
        for core_request in processed_request.core_requests:
            llm.engine_core.add_request(core_request)
        llm.engine_core.step()  # a 16-token chunk: the first image starts in it
        snapshot = llm.engine_core.xray_snapshot(XrayLimits())
        (request,) = snapshot.running
        features = processed_request.core_requests[0].mm_features
        assert request.num_images == 2
        assert request.num_image_tokens == sum(f.num_embeds for f in features)
        assert snapshot.encoder_cache.capacity == 64
        assert snapshot.encoder_cache.num_entries == snapshot.encoder_cache.num_in_use == 1
        assert snapshot.steps.num_images_encoded[-1] == 1
        llm.engine_core.abort_requests([request.req_id])


def test_prompt_ids_equal_the_checkpoint_processor_s_own(checkpoint):
    """Each image expanded alone, the prompt tokenized whole: the ids transformers'
    processor gives for the whole prompt and all its images at once."""
    from transformers import AutoProcessor

    from engine.multimodal.processor import ImagePromptProcessor

    a, b, c = sample_images()
    prompt = chat_prompt("Compare these three.", 3)
    ours = ImagePromptProcessor.for_model(checkpoint).process(
        prompt, [_Image(a), _Image(b), _Image(c)])
    theirs = AutoProcessor.from_pretrained(checkpoint)(
        text=[prompt], images=[[a, b, c]], add_special_tokens=False)
    assert ours.token_ids == list(theirs["input_ids"][0])
    assert [f.num_embeds for f in ours.features] == [20, 20, 12]  # tiles of 4 soft tokens
    with pytest.raises(ValueError, match="placeholders"):  # the text spells an image token
        ImagePromptProcessor.for_model(checkpoint).process(chat_prompt("<image> hi", 1),
                                                           [_Image(a)])
