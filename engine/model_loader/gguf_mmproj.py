"""A llama.cpp vision projector GGUF (`--mmproj`, llama.cpp's `clip` architecture) beside a
text GGUF: the two served, in place, as one SmolVLM / Idefics3 model.

    --model smolvlm-text.gguf              --mmproj mmproj-smolvlm.gguf
      llama metadata -> text_config          clip.vision.* -> vision_config, scale_factor
      tokenizer (its <image>, <row_i_col_j>, clip.vision.image_size / preproc_image_size /
        ... are added tokens), chat template   image_mean / image_std -> the processor
                          │                                  │
                          ▼  conversion, cached (engine.model_loader.gguf)
    $PAGEDSERVE_CACHE/gguf/<text stem>-<key of both files>/
        config.json               Idefics3Config: text_config, vision_config, scale_factor,
                                  image_token_id = the tokenizer's <image>
        processor_config.json     Idefics3Processor (image_seq_len) on Idefics3ImageProcessorPil
        tokenizer files, generation_config.json, chat_template.jinja (as for a text GGUF)
        gguf_source.json          {"gguf_file": text, "mmproj_file": mmproj}
                          │
                          ▼  load (engine.model_loader.gguf_weights)
    text tensors -> model.* / lm_head, in their own formats as for any text GGUF;
    mmproj tensors -> vision_model.* / connector.* (load_mmproj_weights), dequantized to the
    plain torch vision modules (engine.models.idefics3, engine.models.siglip)

Projector types: `idefics3` (SmolVLM, SmolVLM2, Idefics3); anything else is refused in one
line. The mmproj's tensors may be F32, F16, BF16 or Q8_0; its text partner must be a llama
GGUF whose vocabulary holds `<image>`, with the connector's output width as its hidden size.

torch is imported only by `load_mmproj_weights`: conversion runs in the HTTP frontend.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.model_loader.gguf_file import GGUFFile, UnsupportedGGUFError

# clip.projector_type -> the models it serves
SUPPORTED_PROJECTORS = {"idefics3": "SmolVLM, SmolVLM2, Idefics3"}
# What an mmproj's tensors may be: each is dequantized into a float vision parameter.
MMPROJ_TYPES = tuple(GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "Q8_0"))
IMAGE_TOKEN = "<image>"
# transformers' Idefics3 processor resizes to 4 tiles' width when no preproc size is given
# (Idefics3ImageProcessor: size 4 * 364, max_image_size 364).
DEFAULT_RESIZE_TILES = 4

# llama.cpp's clip tensor names -> ours (engine.models.idefics3 / siglip).
_GLOBAL_NAMES = {
    "v.patch_embd.weight": "vision_model.embeddings.patch_embedding.weight",
    "v.patch_embd.bias": "vision_model.embeddings.patch_embedding.bias",
    "v.position_embd.weight": "vision_model.embeddings.position_embedding.weight",
    "v.post_ln.weight": "vision_model.post_layernorm.weight",
    "v.post_ln.bias": "vision_model.post_layernorm.bias",
    "mm.model.fc.weight": "connector.modality_projection.proj.weight",
}
_LAYER_NAMES = {
    "ln1": "layer_norm1", "ln2": "layer_norm2",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
}
_LAYER_TENSOR = re.compile(r"^v\.blk\.(\d+)\.(\w+)\.(weight|bias)$")


def open_mmproj(path: str | Path) -> GGUFFile:
    """The mmproj file, checked (check_mmproj); UnsupportedGGUFError in one line."""
    path = Path(path)
    if path.suffix != ".gguf":
        raise UnsupportedGGUFError(f"{path.name}: an mmproj must be a .gguf file")
    mmproj = GGUFFile(path)
    check_mmproj(mmproj)
    return mmproj


def check_mmproj(mmproj: GGUFFile) -> None:
    """One-line UnsupportedGGUFError for an mmproj we cannot serve: not a `clip` file, no
    vision encoder, another projector type, a tensor with no place here, of a type we do
    not read, past the file's end, or of a shape the metadata contradicts."""
    name = mmproj.path.name
    arch = mmproj.get("general.architecture")
    if arch != "clip":
        raise UnsupportedGGUFError(f"{name} is not a llama.cpp vision projector (mmproj): its "
                                   f"general.architecture is {arch!r}, not 'clip'")
    projector = mmproj.get("clip.projector_type")
    if projector not in SUPPORTED_PROJECTORS:
        supported = ", ".join(f"{p} ({models})" for p, models in SUPPORTED_PROJECTORS.items())
        raise UnsupportedGGUFError(f"{name}: projector type {projector!r} is not supported; "
                                   f"supported: {supported}")
    if not mmproj.get("clip.has_vision_encoder", False):
        raise UnsupportedGGUFError(f"{name} has no vision encoder (clip.has_vision_encoder)")
    if mmproj.get("clip.use_silu", False):
        raise UnsupportedGGUFError(f"{name}: a SiLU vision MLP (clip.use_silu) is not "
                                   "SigLIP's; only GELU towers are served")
    file_size = mmproj.path.stat().st_size
    expected = _expected_shapes(mmproj)
    for gguf_name, info in mmproj.tensors.items():
        ours = mmproj_tensor_name(gguf_name)
        if info.ggml_type not in MMPROJ_TYPES:
            raise UnsupportedGGUFError(
                f"{name}: tensor {gguf_name!r} has GGML type {info.ggml_type.name}; an mmproj's "
                f"tensors may be {', '.join(t.name for t in MMPROJ_TYPES)}")
        if info.offset + info.num_bytes > file_size:
            raise UnsupportedGGUFError(f"{name} is truncated: tensor {gguf_name!r} ends at byte "
                                       f"{info.offset + info.num_bytes:,}, the file at "
                                       f"{file_size:,}")
        want = expected(ours)
        if want is not None and tuple(info.shape) != want:
            raise UnsupportedGGUFError(
                f"{name}: tensor {gguf_name!r} has shape {list(info.shape)}, but the file's "
                f"metadata describes a vision tower where it is {list(want)}")


def mmproj_tensor_name(name: str) -> str:
    """One mmproj tensor's name in our model. Example: 'v.blk.3.attn_out.bias' ->
    'vision_model.encoder.layers.3.self_attn.out_proj.bias'. UnsupportedGGUFError for a
    tensor the Idefics3 tower has no place for."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.match(name)
    if match is None or match[2] not in _LAYER_NAMES:
        raise UnsupportedGGUFError(f"unsupported mmproj tensor {name!r} (an idefics3 "
                                   "projector has v.patch_embd, v.position_embd, v.blk.N.{"
                                   f"{','.join(_LAYER_NAMES)}}}, v.post_ln, mm.model.fc)")
    layer, kind, leaf = match.groups()
    return f"vision_model.encoder.layers.{layer}.{_LAYER_NAMES[kind]}.{leaf}"


def _meta(mmproj: GGUFFile, key: str, default: Any = None) -> Any:
    """A `clip.vision.*` value; a required one (default None) that is absent is an error."""
    value = mmproj.get(f"clip.vision.{key}", default)
    if value is None:
        raise UnsupportedGGUFError(f"{mmproj.path.name}: metadata lacks clip.vision.{key}")
    return value


def vision_settings(mmproj: GGUFFile) -> dict[str, Any]:
    """The vision tower's settings from `clip.vision.*`, by Idefics3VisionConfig's names."""
    return dict(
        image_size=int(_meta(mmproj, "image_size")),
        patch_size=int(_meta(mmproj, "patch_size")),
        hidden_size=int(_meta(mmproj, "embedding_length")),
        intermediate_size=int(_meta(mmproj, "feed_forward_length")),
        num_hidden_layers=int(_meta(mmproj, "block_count")),
        num_attention_heads=int(_meta(mmproj, "attention.head_count")),
        # a float32 in the file: 1e-6 reads as 9.99999997e-07; its float32 text is "1e-06"
        layer_norm_eps=float(str(np.float32(_meta(mmproj, "attention.layer_norm_epsilon",
                                                  1e-6)))),
        num_channels=3,
        hidden_act="gelu_pytorch_tanh",  # llama.cpp's clip GELU is the tanh approximation
    )


def scale_factor(mmproj: GGUFFile) -> int:
    return int(_meta(mmproj, "projector.scale_factor"))


def _expected_shapes(mmproj: GGUFFile):
    """Our tensor name -> the shape (numpy order) the metadata implies (None: unchecked)."""
    v = vision_settings(mmproj)
    hidden, inter, patch = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    num_patches = (v["image_size"] // patch) ** 2
    scale = scale_factor(mmproj)
    top = {
        # GGML's ne of the patch conv is [kw, kh, in, out] = [8, 8, 3, 32] (patch 8, width
        # 32); GGUFFile gives numpy order, ne reversed: [32, 3, 8, 8], which is nn.Conv2d's
        # [out, in, kh, kw] as it is: no transpose.
        "vision_model.embeddings.patch_embedding.weight": (hidden, 3, patch, patch),
        "vision_model.embeddings.patch_embedding.bias": (hidden,),
        "vision_model.embeddings.position_embedding.weight": (num_patches, hidden),
        "vision_model.post_layernorm.weight": (hidden,),
        "vision_model.post_layernorm.bias": (hidden,),
        # [text hidden, vision hidden * s^2]: the rows are checked against the text model
        "connector.modality_projection.proj.weight": None,
    }
    leaves = {
        "layer_norm1.weight": (hidden,), "layer_norm1.bias": (hidden,),
        "layer_norm2.weight": (hidden,), "layer_norm2.bias": (hidden,),
        "mlp.fc1.weight": (inter, hidden), "mlp.fc1.bias": (inter,),
        "mlp.fc2.weight": (hidden, inter), "mlp.fc2.bias": (hidden,),
        **{f"self_attn.{p}_proj.{leaf}": (hidden, hidden) if leaf == "weight" else (hidden,)
           for p in ("q", "k", "v", "out") for leaf in ("weight", "bias")},
    }
    fc = mmproj.tensors.get("mm.model.fc.weight")
    if fc is not None and fc.shape[-1] != hidden * scale**2:
        raise UnsupportedGGUFError(
            f"{mmproj.path.name}: mm.model.fc.weight has {fc.shape[-1]} columns; vision width "
            f"{hidden} pixel-shuffled by scale factor {scale} makes {hidden * scale**2}")

    def expected(ours: str):
        if ours in top:
            return top[ours]
        return leaves.get(ours.split(".", 4)[-1])  # vision_model.encoder.layers.N.<leaf>

    return expected


def vision_language_config(text_gguf: GGUFFile, text_config, mmproj: GGUFFile, tokenizer):
    """The Idefics3Config of the pair: `text_config` (what config_from_gguf made of the text
    GGUF) under the vision tower and connector the mmproj describes. UnsupportedGGUFError
    when the text model is not the projector's partner."""
    from transformers import Idefics3Config

    pair = f"{text_gguf.path.name} + {mmproj.path.name}"
    text_arch = text_gguf.get("general.architecture")
    if text_arch != "llama":
        raise UnsupportedGGUFError(f"{pair}: an idefics3 projector's language model is a "
                                   f"llama GGUF, not {text_arch!r}")
    image_token_id = tokenizer.get_vocab().get(IMAGE_TOKEN)
    if image_token_id is None:
        raise UnsupportedGGUFError(f"{pair}: the text GGUF's vocabulary has no {IMAGE_TOKEN} "
                                   "token, so it is not this projector's language model (a "
                                   "text-only model?)")
    fc_rows = mmproj.tensors["mm.model.fc.weight"].shape[0]
    if fc_rows != text_config.hidden_size:
        raise UnsupportedGGUFError(f"{pair}: the projector writes {fc_rows}-wide image "
                                   f"embeddings; the text model's hidden size is "
                                   f"{text_config.hidden_size}")
    tied = bool(text_config.tie_word_embeddings)
    return Idefics3Config(
        text_config=text_config.to_dict(), vision_config=vision_settings(mmproj),
        scale_factor=scale_factor(mmproj), image_token_id=int(image_token_id),
        tie_word_embeddings=tied, architectures=["Idefics3ForConditionalGeneration"],
        pad_token_id=text_config.pad_token_id, dtype=text_config.dtype)


def image_seq_len(mmproj: GGUFFile) -> int:
    """Image tokens per tile: (image_size / patch_size)^2 patches, pixel-shuffled by s^2.
    Example: SmolVLM-256M, 512 / 16 = 32 -> 1024 patches / 4^2 = 64."""
    v = vision_settings(mmproj)
    return (v["image_size"] // v["patch_size"]) ** 2 // scale_factor(mmproj) ** 2


def save_processor(mmproj: GGUFFile, tokenizer, out_dir: Path) -> None:
    """The Idefics3Processor of transformers' SmolVLM defaults (LANCZOS, rescale 1/255, pad,
    split into tiles of image_size plus a global tile), sized by the mmproj: resize to
    `preproc_image_size` on the longest edge, tiles of `image_size`, its mean and std."""
    from transformers import Idefics3Processor
    from transformers.image_utils import PILImageResampling
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    tile = int(_meta(mmproj, "image_size"))
    resize = int(mmproj.get("clip.vision.preproc_image_size") or DEFAULT_RESIZE_TILES * tile)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": resize}, max_image_size={"longest_edge": tile},
        image_mean=[float(x) for x in _meta(mmproj, "image_mean", [0.5, 0.5, 0.5])],
        image_std=[float(x) for x in _meta(mmproj, "image_std", [0.5, 0.5, 0.5])],
        resample=PILImageResampling.LANCZOS, do_rescale=True, rescale_factor=1 / 255,
        do_normalize=True, do_pad=True, do_image_splitting=True, do_convert_rgb=True)
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=image_seq_len(mmproj),
                                  chat_template=tokenizer.chat_template)
    processor.save_pretrained(out_dir)  # also writes the tokenizer, the template


def load_mmproj_weights(model, path: str | Path) -> int:
    """Fill `model`'s vision tower and connector (every parameter under `vision_model.` and
    `connector.`) from the mmproj file, dequantized; the number of tensors. ValueError for
    a tensor with no place, a shape mismatch, or a parameter left unfilled."""
    import torch

    from engine.models.layers import copy_checked

    mmproj = open_mmproj(path)
    params = {name: param for name, param in model.named_parameters()
              if name.startswith(("vision_model.", "connector."))}
    filled: set[str] = set()
    with torch.no_grad():
        for gguf_name in mmproj.tensors:
            ours = mmproj_tensor_name(gguf_name)
            if ours not in params:
                raise ValueError(f"mmproj tensor {gguf_name!r} has no place in "
                                 f"{type(model).__name__} (looked for {ours!r})")
            copy_checked(params[ours], torch.from_numpy(mmproj.load(gguf_name)), gguf_name)
            filled.add(ours)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                          if len(missing) > 5 else "")
        raise ValueError(f"{mmproj.path.name} did not fill {len(missing)} vision "
                         f"parameter(s): {shown}")
    return len(filled)
