"""A tiny random Idefics3 (SmolVLM-architecture) checkpoint, built offline, and test images.

    build_tiny_idefics3_checkpoint(dir)   -> dir with config.json, model.safetensors, the
                                             tokenizer (Idefics3's special tokens, a SmolVLM
                                             chat template) and an Idefics3Processor
    sample_images()                         -> three RGB PIL images: 64x48, 20x30, 96x32

The shapes, chosen so that every path of the image processor runs on tiny tensors:

    vision tower   image_size 32, patch_size 8: a tile is a 4 x 4 grid of 16 patches
    connector      scale_factor 2: 16 patches -> 4 image tokens per tile (image_seq_len 4)
    processor      size longest_edge 64, max_image_size longest_edge 32, splitting on:
                   a 64x48 image -> resized to 64x48 -> 64x64 -> 2 x 2 tiles + a global tile
                   a 20x30 image -> 44x64 -> 64x64 -> 2 x 2 tiles + a global tile
                   a 96x32 image -> 64x22 -> 64x32 -> 1 x 2 tiles + a global tile
    text model     Llama: hidden 64, 2 layers, 4 query / 2 KV heads of 16, vocab 512

    build_tiny_gemma3_vision_checkpoint(dir) -> dir with a tiny Gemma 3 vision-language
                                             checkpoint (Gemma3ForConditionalGeneration), its
                                             tokenizer (<start_of_image>, <image_soft_token>,
                                             <end_of_image>; a Gemma 3 chat template) and a
                                             Gemma3Processor on the PIL image processor

The Gemma 3 shapes:

    vision tower   SigLIP, image_size 32, patch_size 8: 16 patches; no pooling head
    projector      mm_tokens_per_image 4: the 4 x 4 patch grid average-pooled 2 x 2
    processor      every image resized to 32 x 32 (pan and scan off): one crop, expanded
                   "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    text model     Gemma 3: hidden 64, 6 layers (5 local : 1 global, window 64), 4 query /
                   2 KV heads of 16, vocab 512, tied embeddings, logits not soft-capped
                   (as every Gemma 3 release; transformers' Gemma3ForConditionalGeneration
                   would ignore a cap anyway)

Weights are seeded noise large enough that the logits depend on the image (norm weights
1 + 0.2 * noise, everything else 0.2 * noise), as tests/support/model_fixtures.py does for
the text models.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from tests.support.model_fixtures import build_tiny_tokenizer

IMAGE_SEQ_LEN = 4  # image tokens per tile: (32 / 8)^2 / 2^2
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
# The processor looks up <row_{i}_col_{j}> for i, j in 1..6 (processing_idefics3.py).
ROW_COL_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
VLM_SPECIAL_TOKENS = [FAKE_IMAGE_TOKEN, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE,
                      *ROW_COL_TOKENS]

# SmolVLM-Instruct's template: content is a list of parts, an image part becomes <image>
# (which the processor expands into the tile sequence).
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def build_vlm_tokenizer():
    """The tiny byte-level BPE tokenizer plus Idefics3's special tokens; EOS <end_of_utterance>."""
    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VLM_SPECIAL_TOKENS})
    tokenizer.eos_token = END_OF_UTTERANCE
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    return tokenizer


def tiny_idefics3_config(tokenizer, *, tie_word_embeddings: bool = False,
                         architecture: str = "Idefics3ForConditionalGeneration"):
    """The Idefics3Config of the shapes in the module doc, its token ids from `tokenizer`."""
    from transformers import Idefics3Config

    eos_id = tokenizer.convert_tokens_to_ids(END_OF_UTTERANCE)
    text_config = dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
        rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision_config = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, layer_norm_eps=1e-6)
    return Idefics3Config(
        text_config=text_config, vision_config=vision_config, scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        tie_word_embeddings=tie_word_embeddings, architectures=[architecture],
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_processor(tokenizer):
    """Idefics3Processor on the PIL image processor (torchvision is not needed)."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
        do_image_splitting=True)
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                             image_seq_len=IMAGE_SEQ_LEN, chat_template=SMOLVLM_CHAT_TEMPLATE)


def build_hf_idefics3(config, seed: int = 0):
    """transformers' Idefics3ForConditionalGeneration with seeded noise weights (fp32, eval)."""
    from transformers import Idefics3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def build_tiny_idefics3_checkpoint(out_dir: str | Path, seed: int = 0, *,
                                   tie_word_embeddings: bool = False,
                                   architecture: str = "Idefics3ForConditionalGeneration"
                                   ) -> Path:
    """Save the tiny random checkpoint (safetensors), its tokenizer, processor and
    generation config into `out_dir`; `transformers.Idefics3ForConditionalGeneration` and
    `AutoProcessor` load it from there. `architecture` "SmolVLMForConditionalGeneration"
    writes that name into config.json (same weights and layout)."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tokenizer = build_vlm_tokenizer()
    config = tiny_idefics3_config(tokenizer, tie_word_embeddings=tie_word_embeddings)
    model = build_hf_idefics3(config, seed)
    model.config.architectures = [architecture]
    model.save_pretrained(out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_UTTERANCE)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    processor = build_tiny_processor(tokenizer)
    processor.save_pretrained(out_dir)  # also writes the tokenizer (with its template)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# Gemma 3's image tokens (the names its tokenizer_config.json gives them: boi_token,
# image_token, eoi_token), and its turn markers.
GEMMA3_BOI_TOKEN = "<start_of_image>"
GEMMA3_IMAGE_TOKEN = "<image_soft_token>"
GEMMA3_EOI_TOKEN = "<end_of_image>"
GEMMA3_START_OF_TURN = "<start_of_turn>"
GEMMA3_END_OF_TURN = "<end_of_turn>"
GEMMA3_MM_TOKENS_PER_IMAGE = 4  # (32 / 8)^2 patches average-pooled 2 x 2

# Gemma 3's template (google/gemma-3-*-it), trimmed of its checks: a system message is
# folded into the first user turn; an image part writes <start_of_image>, which the
# processor expands into the image's run.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% if messages[0]['content'] is string %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}"
    "{% else %}{% set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' %}"
    "{% endif %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def build_gemma3_vlm_tokenizer():
    """The tiny byte-level BPE tokenizer plus Gemma 3's image tokens, under the names
    Gemma3Processor reads (tokenizer.boi_token / image_token / eoi_token and their ids),
    and its turn markers; EOS <end_of_turn>, Gemma 3's chat template."""
    from transformers import PreTrainedTokenizerFast

    base = build_tiny_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, bos_token=base.bos_token,
        eos_token=GEMMA3_END_OF_TURN, pad_token=base.pad_token,
        extra_special_tokens={"boi_token": GEMMA3_BOI_TOKEN, "image_token": GEMMA3_IMAGE_TOKEN,
                              "eoi_token": GEMMA3_EOI_TOKEN},
        chat_template=GEMMA3_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": [GEMMA3_START_OF_TURN,
                                                                GEMMA3_END_OF_TURN]})
    return tokenizer


def tiny_gemma3_vision_config(tokenizer, *, sliding_window: int = 64,
                              tie_word_embeddings: bool = True):
    """The Gemma3Config of the module doc's shapes, its token ids from `tokenizer`."""
    from transformers import Gemma3Config

    eos_id = tokenizer.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
    text_config = dict(
        model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=sliding_window, final_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=1024,
        rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=tie_word_embeddings,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision_config = dict(
        model_type="siglip_vision_model", image_size=32, patch_size=8, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, layer_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", vision_use_head=False)
    return Gemma3Config(
        text_config=text_config, vision_config=vision_config,
        mm_tokens_per_image=GEMMA3_MM_TOKENS_PER_IMAGE,
        boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id, tie_word_embeddings=tie_word_embeddings,
        architectures=["Gemma3ForConditionalGeneration"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_gemma3_processor(tokenizer):
    """Gemma3Processor on the PIL image processor (torchvision is not needed): 32 x 32,
    pan and scan off, GEMMA3_MM_TOKENS_PER_IMAGE soft tokens an image."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32},
                                              do_pan_and_scan=False)
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                           image_seq_length=GEMMA3_MM_TOKENS_PER_IMAGE,
                           chat_template=GEMMA3_CHAT_TEMPLATE)


def build_hf_gemma3_vision(config, seed: int = 0):
    """transformers' Gemma3ForConditionalGeneration with seeded noise weights (fp32, eval)."""
    from transformers import Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


def build_tiny_gemma3_vision_checkpoint(out_dir: str | Path, seed: int = 0, *,
                                        sliding_window: int = 64,
                                        tie_word_embeddings: bool = True) -> Path:
    """Save the tiny random Gemma 3 vision-language checkpoint (safetensors), its
    tokenizer, processor and generation config into `out_dir`;
    `transformers.Gemma3ForConditionalGeneration` and `AutoProcessor` load it from there."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tokenizer = build_gemma3_vlm_tokenizer()
    config = tiny_gemma3_vision_config(tokenizer, sliding_window=sliding_window,
                                       tie_word_embeddings=tie_word_embeddings)
    build_hf_gemma3_vision(config, seed).save_pretrained(out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(GEMMA3_END_OF_TURN)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out_dir)
    build_gemma3_processor(tokenizer).save_pretrained(out_dir)  # also writes the tokenizer
    tokenizer.save_pretrained(out_dir)
    return out_dir


def sample_images():
    """Three RGB PIL images of different sizes and aspect ratios, deterministic noise
    plus a gradient each (64x48, 20x30, 96x32; width x height)."""
    from PIL import Image

    rng = np.random.default_rng(1234)
    images = []
    for width, height in ((64, 48), (20, 30), (96, 32)):
        noise = rng.integers(0, 256, size=(height, width, 3))
        ramp = np.linspace(0, 255, width)[None, :, None] * rng.uniform(0.2, 1.0, size=3)
        pixels = (0.6 * noise + 0.4 * ramp).clip(0, 255).astype(np.uint8)
        images.append(Image.fromarray(pixels, mode="RGB"))
    return images


sample_images.__test__ = False  # a helper, not a pytest test


def bilevel_png(width: int, height: int) -> bytes:
    """A real width x height PNG of zeros at 1 bit per pixel, built without Pillow: a
    20000 x 20000 one is ~50 MB inflated and compresses to tens of KB."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body))
    rows = (b"\x00" + bytes((width + 7) // 8)) * 1000
    compressor = zlib.compressobj(9)
    idat = b"".join(compressor.compress(rows) for _ in range(height // 1000))
    idat += compressor.compress((b"\x00" + bytes((width + 7) // 8)) * (height % 1000))
    idat += compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat)
            + chunk(b"IEND", b""))
