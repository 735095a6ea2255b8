"""Idefics3 / SmolVLM: a SigLIP-style vision tower, a pixel-shuffle connector and the
Llama decoder (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`).

    image tiles [N, 3, H, W] -> vision_model (patch conv + position embeddings
                                -> bidirectional encoder layers -> post_layernorm)
                             -> connector (pixel shuffle by scale_factor, linear)
                             -> [N * image_seq_len, text hidden]      (encode_images)
    prompt ids [T] -> embed_input_ids -> rows at <image> positions overwritten by the
                      image rows, in order -> Llama decoder -> norm -> lm_head

The text model is our `DecoderModel` (paged attention, tensor parallel, quantizable
linears, the fused CPU stack); the vision tower and the connector are plain torch
modules (never quantized, replicated on every tensor-parallel rank) that follow
transformers' `modeling_idefics3.py` op for op. The tower is SigLIP's encoder
(engine.models.siglip) behind embeddings that bucket positions by the tile's patch mask.

Checkpoint names (transformers 4.4x and 5) -> ours:

    model.text_model.*    -> model.*            (q/k/v and gate/up merged as for Llama)
    lm_head.weight        -> lm_head.weight     (absent when tied: the embedding serves)
    model.vision_model.*  -> vision_model.*
    model.connector.*     -> connector.*
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.models.checkpoint_tensor import CheckpointTensor, read_rows
from engine.models.layers import LMHead, copy_checked
from engine.models.llama import DecoderForCausalLM
from engine.models.siglip import SiglipEncoder, SiglipVisionEmbeddings, as_int
from engine.models.weight_utils import load_named_weights


def patch_attention_mask_of(pixel_attention_mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """[N, H, W] bool pixel mask -> [N, H / p, W / p] bool: a patch is valid when any of
    its pixels is. Example, p = 8, a 32x32 tile whose valid region is 20 rows x 28 columns:
    patch rows 0-2 and patch columns 0-3 are valid (row 2 covers pixel rows 16-23)."""
    subgrid = pixel_attention_mask.unfold(1, patch_size, patch_size)
    subgrid = subgrid.unfold(2, patch_size, patch_size)
    return subgrid.sum(dim=(-1, -2)) > 0


class Idefics3VisionEmbeddings(SiglipVisionEmbeddings):
    """SigLIP's patch and position embeddings, the positions bucketed for tiles whose
    valid region is smaller than the `num_patches_per_side`^2 grid."""

    def position_ids(self, patch_attention_mask: torch.Tensor) -> torch.Tensor:
        """[N, h, w] bool -> [N, h * w] long: each valid patch's position in the full grid.

        The valid region (n_h x n_w patches) is stretched over the grid: patch (i, j) takes
        grid row bucket(i / n_h) and column bucket(j / n_w), with the grid's side split into
        `num_patches_per_side` equal buckets. Padding patches get position 0.
        Example, a 4 x 4 grid, valid region 2 x 4 patches: rows 0, 1 -> grid rows 0, 2;
        so patch (1, 3) -> 2 * 4 + 3 = 11.
        """
        batch_size, max_patches_h, max_patches_w = patch_attention_mask.shape
        device = patch_attention_mask.device
        side = self.num_patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        step_h = 1.0 / patch_attention_mask[:, :, 0].sum(dim=1)  # [N]
        step_w = 1.0 / patch_attention_mask[:, 0, :].sum(dim=1)
        h_indices = torch.arange(max_patches_h, device=device, dtype=torch.float32)
        w_indices = torch.arange(max_patches_w, device=device, dtype=torch.float32)
        fraction_h = torch.clamp(h_indices[None, :] * step_h[:, None], max=1.0 - 1e-6)
        fraction_w = torch.clamp(w_indices[None, :] * step_w[:, None], max=1.0 - 1e-6)
        bucket_h = torch.bucketize(fraction_h, boundaries, right=True)  # [N, h]
        bucket_w = torch.bucketize(fraction_w, boundaries, right=True)  # [N, w]
        grid_ids = (bucket_h[:, :, None] * side + bucket_w[:, None, :]).reshape(batch_size, -1)
        return torch.where(patch_attention_mask.view(batch_size, -1), grid_ids,
                           torch.zeros_like(grid_ids))

    def forward(self, pixel_values: torch.Tensor,
                patch_attention_mask: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W], [N, H / p, W / p] bool -> [N, (H / p) * (W / p), hidden]."""
        return (self.patch_embeddings(pixel_values)
                + self.position_embedding(self.position_ids(patch_attention_mask)))


class Idefics3VisionTransformer(nn.Module):
    """Tiles [N, 3, H, W] + patch mask [N, H / p, W / p] -> [N, (H / p) * (W / p), hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        self.embeddings = Idefics3VisionEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor,
                patch_attention_mask: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embeddings(pixel_values, patch_attention_mask)
        key_mask = patch_attention_mask.view(pixel_values.shape[0], -1)
        if bool(key_mask.all()):
            key_mask = None  # no padding: unmasked attention, as transformers runs it
        return self.post_layernorm(self.encoder(hidden_states, key_mask))


class Idefics3SimpleMLP(nn.Module):
    """The modality projection: vision hidden * scale_factor^2 -> text hidden, no bias."""

    def __init__(self, vision_hidden: int, scale_factor: int, text_hidden: int):
        super().__init__()
        self.proj = nn.Linear(vision_hidden * scale_factor**2, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def pixel_shuffle(x: torch.Tensor, scale_factor: int) -> torch.Tensor:
    """[N, side * side, D] -> [N, (side / s)^2, s * s * D]: each s x s block of the patch
    grid becomes one token, its patches concatenated row by row.

    Worked example, a 4 x 4 grid (seq 16), s = 2: output token 1 (block row 0, block
    column 1) = concat(patch (0, 2), patch (0, 3), patch (1, 2), patch (1, 3)), i.e. input
    tokens 2, 3, 6, 7; output token 2 = input tokens 8, 9, 12, 13. The same order as
    transformers' Idefics3Connector.pixel_shuffle (its two view/permute rounds).
    """
    batch_size, seq_len, dim = x.shape
    side = int(seq_len**0.5)
    if side * side != seq_len or side % scale_factor:
        raise ValueError(f"pixel shuffle of {seq_len} patches by {scale_factor}: not a square "
                         "grid whose side the scale factor divides")
    blocks = side // scale_factor
    # [N, block row, row in block, block column, column in block, D]
    x = x.reshape(batch_size, blocks, scale_factor, blocks, scale_factor, dim)
    x = x.permute(0, 1, 3, 2, 4, 5)  # [N, block row, block column, row in block, col in block, D]
    return x.reshape(batch_size, blocks * blocks, scale_factor * scale_factor * dim)


class Idefics3Connector(nn.Module):
    """Vision hidden states [N, S, Dv] -> image embeddings [N, S / s^2, text hidden]."""

    def __init__(self, config: Any):
        super().__init__()
        self.scale_factor = int(config.scale_factor)
        self.modality_projection = Idefics3SimpleMLP(
            config.vision_config.hidden_size, self.scale_factor, config.text_config.hidden_size)

    def forward(self, image_hidden_states: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(image_hidden_states, self.scale_factor))


class _LanguageModel(nn.Module):
    """The text decoder seen alone (`model.*`, shared with the full model), so the Llama
    loader fills and checks exactly its parameters."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


# checkpoint prefix -> ours, for the vision side (loaded here) and the text side (the
# Llama loader); transformers 4.4x and 5 write the same names.
_VISION_PREFIXES = (("model.vision_model.", "vision_model."), ("model.connector.", "connector."))
_TEXT_PREFIX = ("model.text_model.", "model.")


class Idefics3ForConditionalGeneration(DecoderForCausalLM):
    """The model contract of `engine.models`, plus images:

        embed_input_ids(input_ids [T]) -> [T, hidden] (model dtype; a fresh tensor the
            caller may write image rows into)
        encode_images(pixel_values [tiles, 3, H, W], pixel_attention_mask [tiles, H, W] | None)
            -> [tiles * image_seq_len, hidden]: the rows of one image's <image> tokens
        forward(input_ids, positions, inputs_embeds=None) -> [T, hidden]

    `config` is the transformers Idefics3Config / SmolVLMConfig (`text_config`,
    `vision_config`, `scale_factor`, `image_token_id`); `self.config` is its text config,
    as for the other decoders. The lm_head is tied to the embedding when the top-level
    `tie_word_embeddings` says so (transformers 5's rule), or when the checkpoint has no
    lm_head.weight and the text config ties.
    """

    supports_images = True

    def __init__(self, config: Any):
        text_config = config.text_config
        super().__init__(text_config)
        self.vision_config = config.vision_config
        self.image_token_id = int(config.image_token_id)
        self.scale_factor = int(config.scale_factor)
        self.patch_size = as_int(self.vision_config.patch_size)
        num_patches = (as_int(self.vision_config.image_size) // self.patch_size) ** 2
        self.image_seq_len = num_patches // self.scale_factor**2  # image tokens per tile
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if tied != self.tie_word_embeddings:
            self._build_lm_head(tied)
        self.vision_model = Idefics3VisionTransformer(self.vision_config)
        self.connector = Idefics3Connector(config)

    def _build_lm_head(self, tied: bool) -> None:
        self.tie_word_embeddings = tied
        weight = self.model.embed_tokens.weight if tied else None
        self.lm_head = LMHead(self.config.hidden_size, self.config.vocab_size, weight=weight)

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.connector.modality_projection.proj.weight.dtype

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] long -> token embeddings [T, hidden] in the model dtype."""
        return self.model.embed_tokens(input_ids)

    def encode_images(self, pixel_values: torch.Tensor,
                      pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One image's tiles -> its image-token embeddings, flattened in order.

        pixel_values [tiles, 3, H, W] (as the HF image processor returns them for one
        image: its split tiles, then the global view; a leading batch dimension is
        flattened in), pixel_attention_mask [tiles, H, W] (bool or 0/1; None: all valid).
        Returns [real tiles * image_seq_len, text hidden] in the model dtype: exactly
        transformers' `get_image_features(...).pooler_output` rows. As there, all-zero tiles
        (the processor's padding between images of different tile counts) are dropped.
        """
        height, width = pixel_values.shape[-2:]
        pixel_values = pixel_values.reshape(-1, pixel_values.shape[-3], height, width)
        pixel_values = pixel_values.to(self.vision_dtype)
        if pixel_attention_mask is None:
            pixel_attention_mask = torch.ones((pixel_values.shape[0], height, width),
                                              dtype=torch.bool, device=pixel_values.device)
        pixel_attention_mask = pixel_attention_mask.reshape(-1, height, width).bool()
        real_tiles = (pixel_values != 0).flatten(1).any(dim=1)
        if not bool(real_tiles.all()):
            pixel_values, pixel_attention_mask = pixel_values[real_tiles], pixel_attention_mask[real_tiles]
        patch_mask = patch_attention_mask_of(pixel_attention_mask, self.patch_size)
        image_features = self.connector(self.vision_model(pixel_values, patch_mask))
        return image_features.reshape(-1, image_features.shape[-1])

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Fill every parameter from the HF checkpoint's (name, tensor) pairs, streamed
        (names in the module doc). ValueError for a tensor with no place here, a shape
        mismatch, or a parameter left unfilled."""
        vision_params = {f"{prefix}.{name}": param
                         for prefix, module in (("vision_model", self.vision_model),
                                                ("connector", self.connector))
                         for name, param in module.named_parameters()}
        filled: set[str] = set()
        lm_head_seen = False

        def text_weights() -> Iterator[tuple[str, CheckpointTensor]]:
            """The text tensors under our names; vision tensors and the lm_head are copied
            in on the way (each as it streams by: a safetensors slice lives only while
            its file is open)."""
            nonlocal lm_head_seen
            for name, tensor in weights:
                target = _rename(name)
                if target.startswith(("vision_model.", "connector.")):
                    if target not in vision_params:
                        raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                         f"{type(self).__name__} (looked for {target!r})")
                    with torch.no_grad():
                        copy_checked(vision_params[target], read_rows(tensor), name)
                    filled.add(target)
                elif target == "lm_head.weight":
                    lm_head_seen = True
                    if not self.tie_word_embeddings:  # tied: the embedding is the head
                        with torch.no_grad():
                            self.lm_head.load_shard("weight", tensor, None)
                elif target.startswith("model."):
                    yield target, tensor
                else:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(self).__name__}")

        load_named_weights(_LanguageModel(self.model), text_weights())
        if not lm_head_seen and not self.tie_word_embeddings:
            if not getattr(self.config, "tie_word_embeddings", False):
                raise ValueError("the checkpoint did not fill lm_head.weight (and neither "
                                 "config ties it to the embedding)")
            self._build_lm_head(True)
        missing = sorted(set(vision_params) - filled)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                              if len(missing) > 5 else "")
            raise ValueError(f"the checkpoint did not fill {len(missing)} vision "
                             f"parameter(s): {shown}")


def _rename(name: str) -> str:
    """A checkpoint name -> ours (module doc); names of no known part are returned as is."""
    for prefix, ours in (*_VISION_PREFIXES, _TEXT_PREFIX):
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM / SmolVLM2 (transformers' `smolvlm`): the Idefics3 architecture, same
    checkpoint layout."""
