"""Our Gemma 3 vision-language model (Gemma3ForConditionalGeneration: SigLIP tower,
pooling projector, the Gemma 3 decoder) against transformers on a tiny random checkpoint
(tests/support/vlm_fixtures.py): image rows, full-prompt logits with images in (their
soft tokens attending both ways), weight names and loading, a checkpoint without its
vision tower served as text, text-only greedy decoding through the offline engine, and the
frontend's prompt processor on the checkpoint."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from engine.attention import AttentionMetadata, set_forward_context
from engine.attention.backends.torch_backend import TorchAttentionBackend
from engine.attention.layer import Attention
from engine.model_loader import load_model
from engine.model_loader.weights import iter_safetensors
from engine.models import get_model_class
from engine.models.gemma3 import Gemma3ForConditionalGeneration, vision_weight_name
from engine.models.siglip import SiglipVisionTransformer
from tests.support.hf_reference import TOP_K_FOR_TIES, Reference, assert_greedy_matches
from tests.support.model_fixtures import prefill_logits
from tests.support.vlm_fixtures import (
    GEMMA3_BOI_TOKEN,
    GEMMA3_MM_TOKENS_PER_IMAGE,
    build_gemma3_vlm_tokenizer,
    build_hf_gemma3_vision,
    build_tiny_gemma3_vision_checkpoint,
    sample_images,
    tiny_gemma3_vision_config,
)

QUESTION = "What is in this picture?"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3_vision"))


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import Gemma3ForConditionalGeneration as HFGemma3

    return HFGemma3.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_model(checkpoint, torch.float32, "cpu")


@pytest.fixture(scope="module")
def images():
    return sample_images()


def image_prompt(processor, num_images: int = 1) -> str:
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": QUESTION}]
    return processor.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True)


def soft_token_spans(token_type_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[(first, end)] of each run of 1s: the blocks transformers' Gemma 3 mask makes
    bidirectional (get_block_sequence_ids_for_mask). [0, 1, 1, 0, 1] -> [(1, 3), (4, 5)]."""
    is_image = np.concatenate([[0], token_type_ids.numpy().astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(is_image))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


@contextlib.contextmanager
def paged_prefill(model, length: int, spans: list[tuple[int, int]] | None):
    """A fresh KV cache on every attention layer and the metadata of one prefill of
    `length` tokens in it (blocks 0, 1, ...), with `spans` as its bidirectional runs;
    the cache is taken away again on exit."""
    backend = TorchAttentionBackend()
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    num_blocks = -(-length // BLOCK_SIZE)
    for layer in layers:
        layer.kv_cache = torch.zeros(backend.kv_cache_shape(
            num_blocks, BLOCK_SIZE, layer.num_kv_heads, layer.head_size))
    metadata = AttentionMetadata.from_host(
        np.asarray([0, length], dtype=np.int32), np.asarray([length], dtype=np.int32),
        np.arange(num_blocks, dtype=np.int32)[None], np.arange(length, dtype=np.int64),
        torch.device("cpu"))
    metadata.bidirectional_spans = {0: spans} if spans else None
    try:
        with set_forward_context(metadata, backend):
            yield
    finally:
        for layer in layers:
            layer.kv_cache = None


@torch.no_grad()
def our_prompt_logits(model, input_ids: torch.Tensor, pixel_values: torch.Tensor | None,
                      spans: list[tuple[int, int]] | None) -> torch.Tensor:
    """All positions' logits [T, vocab] of one prompt, its soft-token rows filled image
    by image in order (what the model runner does), one paged prefill."""
    embeds = model.embed_input_ids(input_ids)
    if pixel_values is not None:
        image_rows = torch.cat([model.encode_images(image) for image in pixel_values])
        image_positions = (input_ids == model.image_token_id).nonzero().squeeze(1)
        assert len(image_positions) == image_rows.shape[0]
        embeds[image_positions] = image_rows
    with paged_prefill(model, len(input_ids), spans):
        hidden_states = model(input_ids, torch.arange(len(input_ids)), inputs_embeds=embeds)
    return model.compute_logits(hidden_states)


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = max(1.0, reference.abs().max().item())
    assert ours.shape == reference.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, atol=1e-4 * scale, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_registry_builds_the_vision_model(ours):
    assert type(ours) is Gemma3ForConditionalGeneration and ours.supports_images
    assert ours.mm_tokens_per_image == GEMMA3_MM_TOKENS_PER_IMAGE
    assert ours.config.hidden_size == 64 and ours.config.sliding_window == 64
    assert isinstance(ours.vision_tower, SiglipVisionTransformer)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied, as Gemma 3 is
    conditional = type("Config", (), {"architectures": ["Gemma3ForConditionalGeneration"]})
    assert get_model_class(conditional) is Gemma3ForConditionalGeneration


@pytest.mark.parametrize("index", [0, 1, 2])
def test_encode_images_matches_hf(index, ours, hf_model, processor, images):
    inputs = processor(text=image_prompt(processor), images=[[images[index]]],
                       return_tensors="pt")
    pixel_values = inputs["pixel_values"]
    assert pixel_values.shape == (1, 3, 32, 32)  # one crop: pan and scan is off
    with torch.no_grad():
        reference = hf_model.model.get_image_features(pixel_values).pooler_output
        rows = ours.encode_images(pixel_values[0])  # [3, H, W], as the frontend sends it
        batched = ours.encode_images(pixel_values)  # [crops, 3, H, W]
    assert rows.shape == (GEMMA3_MM_TOKENS_PER_IMAGE, 64) == reference[0].shape
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, reference[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(batched, rows)
    # The prompt holds exactly as many soft tokens as rows, in one run.
    assert int((inputs["input_ids"] == ours.image_token_id).sum()) == rows.shape[0]
    assert soft_token_spans(inputs["token_type_ids"][0]) == \
        [(int(inputs["input_ids"][0].tolist().index(ours.image_token_id)),
          int(inputs["input_ids"][0].tolist().index(ours.image_token_id)) + rows.shape[0])]


def test_encode_images_flattens_crops_in_order(ours, hf_model, processor, images):
    pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    assert pixel_values.shape == (3, 3, 32, 32)
    with torch.no_grad():
        reference = hf_model.model.get_image_features(pixel_values).pooler_output
        rows = ours.encode_images(pixel_values)
    torch.testing.assert_close(rows, reference.reshape(-1, 64), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="patches"):
        ours.encode_images(torch.zeros(3, 48, 48))  # not the tower's resolution


def test_prompt_logits_with_images_match_hf(ours, hf_model, processor, images):
    """All positions of a one-image prompt for two images, and of a two-image prompt,
    the soft tokens of each image attending to each other (bidirectional_spans)."""
    last_token_logits = []
    for image in images[:2]:
        inputs = processor(text=image_prompt(processor), images=[[image]], return_tensors="pt")
        spans = soft_token_spans(inputs["token_type_ids"][0])
        logits = our_prompt_logits(ours, inputs["input_ids"][0], inputs["pixel_values"], spans)
        with torch.no_grad():
            reference = hf_model(**inputs).logits[0].float()
        assert_logits_close(logits, reference)
        last_token_logits.append(logits[-1])
        # Causal alone is not transformers' answer: the spans matter.
        causal = our_prompt_logits(ours, inputs["input_ids"][0], inputs["pixel_values"], None)
        assert (causal - reference).abs().max() > 1e-2
    # Different images: clearly different predictions for the next token.
    assert (last_token_logits[0] - last_token_logits[1]).abs().max() > 0.5

    pair = [images[2], images[0]]
    inputs = processor(text=image_prompt(processor, 2), images=[pair], return_tensors="pt")
    spans = soft_token_spans(inputs["token_type_ids"][0])
    assert len(spans) == 2
    logits = our_prompt_logits(ours, inputs["input_ids"][0], inputs["pixel_values"], spans)
    with torch.no_grad():
        reference = hf_model(**inputs).logits[0].float()
    assert_logits_close(logits, reference)


def test_window_shorter_than_an_image_and_untied_head_match_hf(processor, images):
    """A 3-token window on the local layers (shorter than an image's 4 soft tokens:
    transformers' AND(window, OR(causal, image block))), an untied lm_head, and the
    weights under transformers 5's in-memory names (model.language_model.*, ...)."""
    config = tiny_gemma3_vision_config(build_gemma3_vlm_tokenizer(), sliding_window=3,
                                       tie_word_embeddings=False)
    hf = build_hf_gemma3_vision(config, seed=5)
    state = hf.state_dict()
    assert any(k.startswith("model.vision_tower.encoder.") for k in state)
    model = Gemma3ForConditionalGeneration(config)
    model.load_weights(state.items())
    model.eval()
    assert not model.tie_word_embeddings and model.lm_head.weight is not \
        model.model.embed_tokens.weight
    inputs = processor(text=image_prompt(processor, 2), images=[images[:2]], return_tensors="pt")
    spans = soft_token_spans(inputs["token_type_ids"][0])
    with torch.no_grad():
        reference = hf(**inputs).logits[0].float()
    assert_logits_close(our_prompt_logits(model, inputs["input_ids"][0],
                                          inputs["pixel_values"], spans), reference)


def test_vision_weight_names():
    assert vision_weight_name("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight") == \
        "vision_tower.encoder.layers.0.mlp.fc1.weight"
    assert vision_weight_name("model.vision_tower.vision_model.post_layernorm.bias") == \
        "vision_tower.post_layernorm.bias"
    assert vision_weight_name("model.vision_tower.embeddings.patch_embedding.weight") == \
        "vision_tower.embeddings.patch_embedding.weight"
    assert vision_weight_name("multi_modal_projector.mm_input_projection_weight") == \
        "multi_modal_projector.mm_input_projection_weight"
    assert vision_weight_name("model.multi_modal_projector.mm_soft_emb_norm.weight") == \
        "multi_modal_projector.mm_soft_emb_norm.weight"
    assert vision_weight_name("language_model.model.norm.weight") is None


def test_hub_layout_names_load_the_same(checkpoint, ours):
    """The Hub's (transformers 4.5x) layout: language_model.model.*,
    vision_tower.vision_model.*; and SigLIP's unused pooling head, skipped."""
    from transformers import AutoConfig

    def hub_name(name: str) -> str:
        if name.startswith("vision_tower."):
            return "vision_tower.vision_model." + name[len("vision_tower."):]
        return name

    tensors = [(hub_name(n), t) for n, t in iter_safetensors(checkpoint)]
    assert any(n.startswith("vision_tower.vision_model.encoder.") for n, _ in tensors)
    tensors.append(("vision_tower.vision_model.head.probe", torch.ones(1, 1, 32)))
    model = Gemma3ForConditionalGeneration(AutoConfig.from_pretrained(checkpoint))
    model.load_weights(tensors)
    for (name, ours_param), theirs in zip(ours.state_dict().items(),
                                          model.state_dict().values(), strict=True):
        assert torch.equal(ours_param, theirs), name


def test_load_weights_refuses_unknown_and_missing_tensors(checkpoint, hf_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    state = hf_model.state_dict()
    for extra in ("model.vision_tower.vision_model.extra.weight",
                  "vision_tower.encoder.layers.9.mlp.fc1.weight",
                  "multi_modal_projector.extra", "model.language_model.extra.weight",
                  "model.resampler.weight"):
        with pytest.raises(ValueError, match="no place"):
            Gemma3ForConditionalGeneration(config).load_weights(
                [*state.items(), (extra, torch.ones(1))])
    incomplete = {k: v for k, v in state.items() if "post_layernorm.bias" not in k}
    with pytest.raises(ValueError, match="post_layernorm.bias"):
        Gemma3ForConditionalGeneration(config).load_weights(incomplete.items())
    no_norm = {k: v for k, v in state.items() if not k.endswith("language_model.norm.weight")}
    with pytest.raises(ValueError, match="norm.weight"):
        Gemma3ForConditionalGeneration(config).load_weights(no_norm.items())
    wrong_shape = dict(state, **{"model.multi_modal_projector.mm_input_projection_weight":
                                 torch.ones(3, 3)})
    with pytest.raises(ValueError, match="shape"):
        Gemma3ForConditionalGeneration(config).load_weights(wrong_shape.items())


def test_int8_quantizes_only_the_text_linears(checkpoint, ours, processor, images):
    from engine.models.layers import Linear

    model = load_model(checkpoint, torch.float32, "cpu", quantization="int8")
    quantized = set(model.quantization_report.specs)
    assert quantized and all(name.startswith(("model.layers.", "lm_head")) for name in quantized)
    vision = [m for name, m in model.named_modules()
              if name.startswith(("vision_tower", "multi_modal_projector"))]
    assert any(isinstance(m, nn.Linear) for m in vision)
    assert not any(isinstance(m, Linear) for m in vision)
    assert all(p.dtype == torch.float32 for m in vision for p in m.parameters())
    pixel_values = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        assert torch.equal(model.encode_images(pixel_values), ours.encode_images(pixel_values))


@pytest.fixture(scope="module")
def text_only_checkpoint(checkpoint, tmp_path_factory):
    """The same checkpoint without its vision tower and projector tensors."""
    import shutil

    out = tmp_path_factory.mktemp("gemma3_text_only")
    for path in checkpoint.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    save_file({n: t.contiguous() for n, t in iter_safetensors(checkpoint)
               if vision_weight_name(n) is None}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def test_checkpoint_without_vision_tensors_is_served_as_text(text_only_checkpoint, ours,
                                                             hf_model):
    model = load_model(text_only_checkpoint, torch.float32, "cpu")
    assert type(model) is Gemma3ForConditionalGeneration
    assert not model.supports_images and type(ours).supports_images
    assert model.vision_tower is None and model.multi_modal_projector is None
    assert not any(isinstance(m, nn.Conv2d) for m in model.modules())
    with pytest.raises(ValueError, match="no vision tower"):
        model.encode_images(torch.zeros(3, 32, 32))
    # The frontend takes no images for it (a request with one is a 400 naming the model).
    from engine.multimodal.processor import ImagePromptProcessor

    assert ImagePromptProcessor.for_model(text_only_checkpoint) is None
    prompt = list(range(5, 45))
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0].float()
    assert_logits_close(prefill_logits(model, [prompt]), reference)
    assert_logits_close(prefill_logits(ours, [prompt]), reference)


def test_text_only_greedy_through_the_engine_matches_hf(checkpoint, text_only_checkpoint,
                                                        hf_model, processor):
    from engine import LLM, SamplingParams

    tokenizer = processor.tokenizer
    texts = ["Hello, world! How are you today?", "The quick brown fox",
             "A paged KV cache stores keys and values in fixed-size blocks."]
    prompts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": t}]}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for t in texts]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompts]
    num_new = 16
    reference = Reference([], [], [])
    with torch.inference_mode():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                    max_new_tokens=num_new, min_new_tokens=num_new,
                                    output_logits=True, return_dict_in_generate=True,
                                    pad_token_id=0)
            logits = torch.cat(out.logits).float()
            reference.token_ids.append(out.sequences[0, len(prompt):].tolist())
            reference.top5.append(logits.topk(TOP_K_FOR_TIES, dim=-1).indices.tolist())
            reference.logprobs.append(torch.log_softmax(logits, dim=-1))
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    for model_dir in (checkpoint, text_only_checkpoint):
        with LLM(str(model_dir), dtype="float32", max_model_len=256, max_num_seqs=4) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        assert all(len(t) == num_new for t in tokens)
        assert assert_greedy_matches(tokens, reference) == 0


def test_image_prompt_processor_on_the_checkpoint(checkpoint, ours, processor, images):
    """The frontend's processor: the template writes <start_of_image> (the processor's
    `image_token`, its `boi_token`), each image expands to
    "\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n"; the embed token is the
    config's image_token_id (<image_soft_token>); the ids are the HF processor's for the
    whole prompt; the tensors feed encode_images as the runner passes them."""
    from engine.multimodal.inputs import image_content_hash
    from engine.multimodal.processor import ImagePromptProcessor

    prompt_processor = ImagePromptProcessor.for_model(checkpoint)
    assert prompt_processor is not None
    assert prompt_processor.placeholder == GEMMA3_BOI_TOKEN == processor.image_token \
        == processor.boi_token
    assert prompt_processor.image_token_id == ours.image_token_id == \
        processor.tokenizer.image_token_id != processor.image_token_id  # the latter: boi

    class Loaded:
        def __init__(self, image):
            self.image, self.content_hash = image, image_content_hash(image)

    pair = [images[1], images[2]]
    prompt = image_prompt(processor, 2)
    assert prompt.count(GEMMA3_BOI_TOKEN) == 2
    processed = prompt_processor.process(prompt, [Loaded(image) for image in pair])
    expected = processor(text=prompt, images=[pair], return_tensors="pt")
    assert processed.token_ids == expected["input_ids"][0].tolist()
    spans = soft_token_spans(expected["token_type_ids"][0])
    for feature, image, (first, end) in zip(processed.features, pair, spans, strict=True):
        assert feature.num_embeds == GEMMA3_MM_TOKENS_PER_IMAGE
        assert feature.embed_span() == (first, end)
        tensors = {name: torch.from_numpy(data.to_array().copy())
                   for name, data in feature.tensors.items()}
        assert set(tensors) == {"pixel_values"} and tensors["pixel_values"].shape == (1, 3, 32, 32)  # its crops
        with torch.no_grad():
            rows = ours.encode_images(**tensors)
        single = processor.image_processor([image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            assert torch.equal(rows, ours.encode_images(single))


def test_images_through_the_engine_match_hf(checkpoint, hf_model, images):
    """Greedy tokens of image prompts through the whole engine (frontend processor,
    encoder cache, paged KV, the soft tokens' bidirectional spans) equal transformers'
    `generate` on the same ids and pixels: alone, batched, and in 10-token steps, whose
    boundaries (10, 20) would fall inside the soft-token runs (8..11, 18..21): the
    scheduler must not cut an image's run."""
    from engine import LLM, SamplingParams
    from engine.multimodal.processor import ImagePromptProcessor

    num_new = 12
    prompts = [
        {"prompt": f"<start_of_turn>user\n{GEMMA3_BOI_TOKEN}What is this?<end_of_turn>\n"
                   "<start_of_turn>model\n", "multi_modal_data": {"image": [images[0]]}},
        {"prompt": f"<start_of_turn>user\n{GEMMA3_BOI_TOKEN}{GEMMA3_BOI_TOKEN}Compare them."
                   "<end_of_turn>\n<start_of_turn>model\n",
         "multi_modal_data": {"image": [images[1], images[2]]}},
    ]
    prompt_processor = ImagePromptProcessor.for_model(checkpoint)
    reference = Reference([], [], [])
    spans = []
    for prompt in prompts:
        processed = prompt_processor.process(
            prompt["prompt"], [_Loaded(p) for p in prompt["multi_modal_data"]["image"]])
        assert all(f.bidirectional for f in processed.features)
        spans.append([f.embed_span() for f in processed.features])
        token_type_ids = torch.zeros(len(processed.token_ids), dtype=torch.long)
        for first, end in spans[-1]:
            token_type_ids[first:end] = 1
        pixel_values = torch.from_numpy(np.concatenate(
            [f.tensors["pixel_values"].to_array() for f in processed.features]))
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([processed.token_ids]), pixel_values=pixel_values,
                token_type_ids=token_type_ids[None], do_sample=False, max_new_tokens=num_new,
                min_new_tokens=num_new, output_logits=True, return_dict_in_generate=True,
                pad_token_id=0)
        logits = torch.cat(out.logits).float()
        reference.token_ids.append(out.sequences[0, len(processed.token_ids):].tolist())
        reference.top5.append(logits.topk(TOP_K_FOR_TIES, dim=-1).indices.tolist())
        reference.logprobs.append(torch.log_softmax(logits, dim=-1))
    assert spans == [[(8, 12)], [(8, 12), (18, 22)]]
    params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
    for options in ({}, {"max_num_batched_tokens": 10, "block_size": 16}):
        with LLM(str(checkpoint), dtype="float32", max_model_len=256, **options) as llm:
            alone = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
                     for p in prompts]
            assert llm.engine_core.reset_prefix_cache()
            batched = [list(o.outputs[0].token_ids)
                       for o in llm.generate(prompts, params, use_tqdm=False)]
        assert assert_greedy_matches(alone, reference) == 0
        assert assert_greedy_matches(batched, reference) == 0


class _Loaded:
    """A decoded image as the frontend holds it (server/common/images.py LoadedImage)."""

    def __init__(self, image):
        from engine.multimodal.inputs import image_content_hash

        self.image, self.content_hash = image, image_content_hash(image)
