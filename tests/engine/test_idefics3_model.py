"""Our Idefics3 / SmolVLM against transformers on a tiny random checkpoint
(tests/support/vlm_fixtures.py): the vision encoder's rows, full-prompt logits with images
in, text-only greedy decoding through the offline engine, and weight loading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.attention import set_forward_context
from engine.attention.backends.torch_backend import TorchAttentionBackend
from engine.model_loader import load_model
from engine.model_loader.weights import iter_safetensors_slices
from engine.models import get_model_class
from engine.models.idefics3 import (
    Idefics3ForConditionalGeneration,
    SmolVLMForConditionalGeneration,
    pixel_shuffle,
)
from engine.models.layers import Linear
from tests.support.hf_reference import TOP_K_FOR_TIES, Reference, assert_greedy_matches
from tests.support.model_fixtures import prefill_metadata
from tests.support.vlm_fixtures import (
    IMAGE_SEQ_LEN,
    build_hf_idefics3,
    build_tiny_idefics3_checkpoint,
    build_vlm_tokenizer,
    sample_images,
    tiny_idefics3_config,
)

QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_idefics3_checkpoint(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def processor(checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import Idefics3ForConditionalGeneration as HFIdefics3

    return HFIdefics3.from_pretrained(checkpoint, dtype=torch.float32).eval()


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


def encode_one(model, processor, image) -> torch.Tensor:
    """Our rows for one image, from the processor's tensors for that image alone."""
    tensors = processor.image_processor([[image]], return_tensors="pt")
    return model.encode_images(tensors["pixel_values"][0], tensors["pixel_attention_mask"][0])


@torch.no_grad()
def our_prompt_logits(model, processor, input_ids: torch.Tensor, images) -> torch.Tensor:
    """All positions' logits [T, vocab] of one prompt, its <image> rows filled image by
    image in order (what the model runner does), one prefill without a KV cache."""
    embeds = model.embed_input_ids(input_ids)
    image_rows = torch.cat([encode_one(model, processor, image) for image in images])
    image_positions = (input_ids == model.image_token_id).nonzero().squeeze(1)
    assert len(image_positions) == image_rows.shape[0]
    embeds[image_positions] = image_rows
    positions = torch.arange(len(input_ids))
    with set_forward_context(prefill_metadata([len(input_ids)]), TorchAttentionBackend()):
        hidden_states = model(input_ids, positions, inputs_embeds=embeds)
    return model.compute_logits(hidden_states)


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = max(1.0, reference.abs().max().item())
    assert ours.shape == reference.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, atol=1e-4 * scale, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_registry_builds_both_architectures(ours):
    assert type(ours) is Idefics3ForConditionalGeneration and ours.supports_images
    assert ours.image_seq_len == IMAGE_SEQ_LEN
    config = ours.config  # the text config
    assert config.hidden_size == 64
    smolvlm = type("Config", (), {"architectures": ["SmolVLMForConditionalGeneration"]})
    assert get_model_class(smolvlm) is SmolVLMForConditionalGeneration


def test_pixel_shuffle_matches_transformers():
    from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector

    x = torch.randn(3, 16, 5)
    reference = Idefics3Connector.pixel_shuffle(None, x, 2)
    torch.testing.assert_close(pixel_shuffle(x, 2), reference, atol=0, rtol=0)
    # The worked example of its docstring: output token 1 = input tokens 2, 3, 6, 7.
    ids = torch.arange(16.0).view(1, 16, 1)
    assert pixel_shuffle(ids, 2)[0, 1].tolist() == [2.0, 3.0, 6.0, 7.0]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_encode_images_matches_hf(index, ours, hf_model, processor, images):
    image = images[index]
    inputs = processor(text=image_prompt(processor), images=[[image]], return_tensors="pt")
    pixel_values, pixel_mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    with torch.no_grad():
        reference = hf_model.model.get_image_features(pixel_values, pixel_mask).pooler_output
        rows = ours.encode_images(pixel_values[0], pixel_mask[0])
    num_tiles = pixel_values.shape[1]
    assert num_tiles == {0: 5, 1: 5, 2: 3}[index]  # 2x2 + global, 2x2 + global, 1x2 + global
    assert rows.shape == (num_tiles * IMAGE_SEQ_LEN, 64) == reference[0].shape
    torch.testing.assert_close(rows, reference[0], atol=1e-5, rtol=1e-5)
    # The prompt holds exactly as many <image> tokens as rows.
    assert int((inputs["input_ids"] == ours.image_token_id).sum()) == rows.shape[0]


def test_encode_images_partial_mask_and_padding_tiles(ours, hf_model, processor, images):
    """A tile whose valid region is 20 x 28 pixels (position-embedding bucketing and key
    masking), no mask (= all valid), and an all-zero padding tile (dropped, as HF does)."""
    pixel_values = processor.image_processor([[images[0]]], return_tensors="pt")["pixel_values"]
    pixel_values = pixel_values.clone()
    mask = torch.ones(pixel_values.shape[:2] + pixel_values.shape[-2:], dtype=torch.bool)
    mask[0, 1, 20:, :] = False
    mask[0, 1, :, 28:] = False
    pixel_values[0, 1] *= mask[0, 1]
    with torch.no_grad():
        reference = hf_model.model.get_image_features(pixel_values, mask).pooler_output[0]
        rows = ours.encode_images(pixel_values[0], mask[0])
        torch.testing.assert_close(rows, reference, atol=1e-5, rtol=1e-5)
        unmasked = hf_model.model.get_image_features(pixel_values).pooler_output[0]
        torch.testing.assert_close(ours.encode_images(pixel_values[0], None), unmasked,
                                   atol=1e-5, rtol=1e-5)
        assert not torch.allclose(unmasked, reference, atol=1e-3)  # the mask mattered
        padded = torch.cat([pixel_values[0], torch.zeros_like(pixel_values[0, :1])])
        padded_mask = torch.cat([mask[0], torch.zeros_like(mask[0, :1])])
        torch.testing.assert_close(ours.encode_images(padded, padded_mask), rows,
                                   atol=0, rtol=0)


def test_prompt_logits_with_images_match_hf(ours, hf_model, processor, images):
    """All positions of a one-image prompt for two images, and a two-image prompt."""
    last_token_logits = []
    for image in images[:2]:
        inputs = processor(text=image_prompt(processor), images=[[image]], return_tensors="pt")
        logits = our_prompt_logits(ours, processor, inputs["input_ids"][0], [image])
        with torch.no_grad():
            reference = hf_model(**inputs).logits[0].float()
        assert_logits_close(logits, reference)
        last_token_logits.append(logits[-1])
    # Different images: clearly different predictions for the next token.
    assert (last_token_logits[0] - last_token_logits[1]).abs().max() > 0.5

    pair = [images[2], images[0]]
    inputs = processor(text=image_prompt(processor, 2), images=[pair], return_tensors="pt")
    logits = our_prompt_logits(ours, processor, inputs["input_ids"][0], pair)
    with torch.no_grad():
        reference = hf_model(**inputs).logits[0].float()
    assert_logits_close(logits, reference)


def test_smolvlm_config_and_tied_head_match_hf(tmp_path, processor, images):
    """A `smolvlm` config (SmolVLMForConditionalGeneration) with a tied lm_head: the
    checkpoint has no lm_head.weight; logits of an image prompt as transformers'."""
    from transformers import SmolVLMConfig
    from transformers import SmolVLMForConditionalGeneration as HFSmolVLM

    idefics3_config = tiny_idefics3_config(build_vlm_tokenizer(), tie_word_embeddings=True)
    config = SmolVLMConfig(**{k: v for k, v in idefics3_config.to_dict().items()
                              if k not in ("model_type", "architectures", "transformers_version")},
                           architectures=["SmolVLMForConditionalGeneration"])
    hf = HFSmolVLM(config).eval()
    hf.load_state_dict(build_hf_idefics3(idefics3_config, seed=3).state_dict())
    hf.save_pretrained(tmp_path)
    hf = HFSmolVLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert "lm_head.weight" not in dict(iter_safetensors_slices(tmp_path))
    model = load_model(tmp_path, torch.float32, "cpu")
    assert type(model) is SmolVLMForConditionalGeneration and model.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    image = images[1]
    inputs = processor(text=image_prompt(processor), images=[[image]], return_tensors="pt")
    with torch.no_grad():
        reference = hf(**inputs).logits[0].float()
    assert_logits_close(our_prompt_logits(model, processor, inputs["input_ids"][0], [image]),
                        reference)


def test_load_weights_refuses_unknown_and_missing_tensors(checkpoint, hf_model):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint)
    state = hf_model.state_dict()
    for extra in ("model.vision_model.extra.weight", "model.text_model.extra.weight",
                  "model.resampler.weight"):
        with pytest.raises(ValueError, match="no place"):
            Idefics3ForConditionalGeneration(config).load_weights(
                [*state.items(), (extra, torch.ones(1))])
    incomplete = {k: v for k, v in state.items() if "post_layernorm.bias" not in k}
    with pytest.raises(ValueError, match="post_layernorm.bias"):
        Idefics3ForConditionalGeneration(config).load_weights(incomplete.items())
    no_head = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="lm_head"):
        Idefics3ForConditionalGeneration(config).load_weights(no_head.items())
    config.text_config.tie_word_embeddings = True  # then a missing head is the embedding
    model = Idefics3ForConditionalGeneration(config)
    model.load_weights(no_head.items())
    assert model.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    wrong_shape = dict(state, **{"model.connector.modality_projection.proj.weight":
                                 torch.ones(3, 3)})
    with pytest.raises(ValueError, match="shape"):
        Idefics3ForConditionalGeneration(config).load_weights(wrong_shape.items())


def test_int8_quantizes_only_the_text_linears(checkpoint):
    model = load_model(checkpoint, torch.float32, "cpu", quantization="int8")
    quantized = set(model.quantization_report.specs)
    assert quantized and all(name.startswith(("model.layers.", "lm_head")) for name in quantized)
    vision_linears = [m for name, m in model.named_modules()
                      if name.startswith(("vision_model", "connector")) and isinstance(m, nn.Linear)]
    assert vision_linears and all(m.weight.dtype == torch.float32 for m in vision_linears)
    assert not any(isinstance(m, Linear) for name, m in model.named_modules()
                   if name.startswith(("vision_model", "connector")))


def test_text_only_greedy_through_the_engine_matches_hf(checkpoint, hf_model, processor):
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
    llm = LLM(str(checkpoint), dtype="float32", max_model_len=512, max_num_seqs=4)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(tokens) == num_new for tokens in ours)
    assert assert_greedy_matches(ours, reference) == 0
