"""Gemma 3: `Gemma3ForCausalLM` (text), `Gemma3ForConditionalGeneration` (text and
images: a SigLIP tower and Gemma 3's projector in front of the same decoder); and Gemma 2
(`Gemma2ForCausalLM`), the same decoder without QK-norm and with soft-capped attention.

Per token, each layer:

    x -> input_layernorm -> self_attn -> post_attention_layernorm -> +residual
      -> pre_feedforward_layernorm -> mlp (GeGLU) -> post_feedforward_layernorm -> +residual

- embeddings scaled by sqrt(hidden_size); every RMSNorm multiplies by (1 + weight);
- q and k RMS-normalised per head before RoPE; attention scale query_pre_attn_scalar^-0.5;
- interleaved local and global layers (`layer_types`): local ones attend to a
  `sliding_window` with their own RoPE base (10k), global ones to everything (1M, and
  the checkpoint's scaling); the KV cache groups them (engine.kv_cache.groups);
- logits soft-capped, cap * tanh(logits / cap), where the config sets
  `final_logit_softcapping`; attention scores likewise with `attn_logit_softcapping`
  (Gemma 2: 50; the attention backends apply it, engine.attention.layer).

As in the Llama decoder, each "+residual" is folded into the next norm: a layer returns
its post-feedforward output and the residual stream.

Images (`Gemma3ForConditionalGeneration`), as transformers' `modeling_gemma3.py`:

    image [3, 896, 896] -> SigLIP tower (engine.models.siglip) -> [4096 patches, 1152]
      -> projector: the 64 x 64 patch grid average-pooled to 16 x 16 (mm_tokens_per_image
         256), Gemma RMSNorm (1 + w), @ mm_input_projection_weight [1152, hidden]
      -> [256, hidden]                                                  (encode_images)
    prompt ids -> scaled token embeddings (embed_input_ids) -> the rows at
      <image_soft_token> positions replaced by the image rows, in order -> the decoder

During prefill an image's soft tokens attend to each other both ways (transformers'
token_type_ids mask); that is the attention metadata's `bidirectional_spans`, set by the
engine; the model itself is the same either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.checkpoint_tensor import CheckpointTensor, read_rows
from engine.models.layers import GatedMLP, LMHead, OffsetRMSNorm, VocabEmbedding, copy_checked
from engine.models.llama import DecoderAttention, layer_sliding_window
from engine.models.rotary import RotaryEmbedding
from engine.models.siglip import SiglipVisionTransformer, as_int
from engine.models.weight_utils import load_named_weights
from engine.openmp import small_ops_on_this_thread

LOCAL, GLOBAL = "sliding_attention", "full_attention"


def text_config_of(config: Any) -> Any:
    """The language model's config (a Gemma3ForConditionalGeneration keeps it in
    `text_config`)."""
    return getattr(config, "text_config", None) or config


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, qk_norm: bool = True):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = DecoderAttention(
            config, qkv_bias=bool(config.attention_bias), o_bias=bool(config.attention_bias),
            qk_norm=qk_norm, sliding_window=layer_sliding_window(config, layer_idx),
            scale=config.query_pre_attn_scalar**-0.5, norm_class=OffsetRMSNorm,
            logit_softcap=getattr(config, "attn_logit_softcapping", None))
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size,
                            hidden_act=config.hidden_activation)
        eps = config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous layer's output, residual stream) -> (this layer's output, stream);
        the first layer gets residual None."""
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(hidden_states, cos, sin))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Any, qk_norm: bool = True):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = math.sqrt(config.hidden_size)
        self.rotary_local = RotaryEmbedding.from_config(config, config.head_dim, LOCAL)
        self.rotary_global = RotaryEmbedding.from_config(config, config.head_dim, GLOBAL)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, qk_norm)
                                    for i in range(config.num_hidden_layers))
        self.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> the scaled token embeddings [T, hidden] (a fresh tensor)."""
        hidden_states = self.embed_tokens(input_ids)
        # transformers rounds the scale to the weights' dtype before multiplying.
        return hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` [T, hidden], if given, replaces `embed(input_ids)` (already
        scaled: the image rows of a vision-language prompt are not)."""
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = {LOCAL: self.rotary_local(positions), GLOBAL: self.rotary_global(positions)}
        residual = None
        for layer in self.layers:
            cos, sin = rope[layer.layer_type]
            hidden_states, residual = layer(hidden_states, residual, cos, sin)
        return self.norm(hidden_states, residual)[0]


class Gemma3ForCausalLM(nn.Module):
    """The contract of `engine.models` (see there)."""

    QK_NORM = True  # q and k RMS-normalised per head (Gemma 3; not Gemma 2)

    def __init__(self, config: Any):
        super().__init__()
        config = text_config_of(config)
        self.config = config
        self.model = Gemma3Model(config, qk_norm=self.QK_NORM)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        tied = self.model.embed_tokens.weight if self.tie_word_embeddings else None
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, weight=tied)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        cap = self.final_logit_softcapping
        with small_ops_on_this_thread(logits):
            logits = logits.float()
            return logits if not cap else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        load_named_weights(self, language_model_weights(weights),
                           skip_lm_head=self.tie_word_embeddings)


class Gemma3RMSNorm(nn.Module):
    """transformers' Gemma3RMSNorm in plain torch: (1 + weight) * x / rms(x) in float32,
    the checkpoint's `weight` kept as stored (the projector's norm)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class Gemma3MultiModalProjector(nn.Module):
    """Vision hidden states [N, side^2, Dv] -> image embeddings [N, mm_tokens_per_image,
    text hidden]: the side x side patch grid average-pooled in k x k blocks
    (k = side / sqrt(mm_tokens_per_image)), normed, projected (no bias).

    Example, a 4 x 4 grid, 4 tokens: k = 2; token 1 = mean of patches 2, 3, 6, 7.
    """

    def __init__(self, vision_config: Any, text_hidden: int, mm_tokens_per_image: int):
        super().__init__()
        self.patches_per_side = as_int(vision_config.image_size) // as_int(vision_config.patch_size)
        self.tokens_per_side = int(mm_tokens_per_image**0.5)
        if (self.tokens_per_side**2 != mm_tokens_per_image
                or self.patches_per_side % self.tokens_per_side):
            raise ValueError(f"mm_tokens_per_image {mm_tokens_per_image} does not pool a "
                             f"{self.patches_per_side} x {self.patches_per_side} patch grid")
        self.kernel_size = self.patches_per_side // self.tokens_per_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision_config.hidden_size, text_hidden))
        self.mm_soft_emb_norm = Gemma3RMSNorm(vision_config.hidden_size,
                                              vision_config.layer_norm_eps)

    def forward(self, vision_outputs: torch.Tensor) -> torch.Tensor:
        batch_size, _, hidden_size = vision_outputs.shape
        side = self.patches_per_side
        grid = vision_outputs.transpose(1, 2).reshape(batch_size, hidden_size, side, side)
        pooled = F.avg_pool2d(grid.contiguous(), self.kernel_size, self.kernel_size)
        pooled = pooled.flatten(2).transpose(1, 2)  # [N, tokens, Dv], row by row
        projected = torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)
        return projected.type_as(vision_outputs)


class _TextModel(nn.Module):
    """The decoder and its head seen alone, so the loader fills and checks exactly
    their parameters (a tied head shares the embedding's and is listed once)."""

    def __init__(self, model: nn.Module, lm_head: nn.Module):
        super().__init__()
        self.model = model
        self.lm_head = lm_head


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The model contract of `engine.models`, plus images:

        embed_input_ids(input_ids [T]) -> [T, hidden]: the scaled token embeddings (what
            transformers scatters the image rows into; a fresh tensor)
        encode_images(pixel_values [3, H, W] or [crops, 3, H, W])
            -> [crops * mm_tokens_per_image, hidden] in the model dtype: exactly
            transformers' `get_image_features(pixel_values).pooler_output` rows, crops in order
        forward(input_ids, positions, inputs_embeds=None) -> [T, hidden]

    `config` is transformers' Gemma3Config (`text_config`, `vision_config`,
    `mm_tokens_per_image`, `image_token_id`: the soft token the rows replace);
    `self.config` is its text config. The head is tied to the embedding as the top-level
    `tie_word_embeddings` says (transformers 5's rule for composite models); the logits
    are not soft-capped (neither are transformers').

    A checkpoint without vision tensors (or a config without `vision_config`) is served
    as text: `supports_images` is then False on the instance and the tower is dropped.
    """

    supports_images = True

    def __init__(self, config: Any):
        super().__init__(config)
        text_config = self.config
        # transformers' Gemma3ForConditionalGeneration returns lm_head(x) as is, whatever
        # the text config's final_logit_softcapping (None in every Gemma 3 release).
        self.final_logit_softcapping = None
        tied = bool(getattr(config, "tie_word_embeddings", self.tie_word_embeddings))
        if tied != self.tie_word_embeddings:
            self.tie_word_embeddings = tied
            self.lm_head = LMHead(text_config.hidden_size, text_config.vocab_size,
                                  weight=self.model.embed_tokens.weight if tied else None)
        vision_config = getattr(config, "vision_config", None) if config is not text_config \
            else None
        self.vision_tower: SiglipVisionTransformer | None = None
        self.multi_modal_projector: Gemma3MultiModalProjector | None = None
        if vision_config is None:
            self.supports_images = False
            return
        self.image_token_id = int(config.image_token_id)
        self.mm_tokens_per_image = int(config.mm_tokens_per_image)
        self.vision_tower = SiglipVisionTransformer(vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            vision_config, text_config.hidden_size, self.mm_tokens_per_image)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] long -> scaled token embeddings [T, hidden] in the model dtype. An image
        token id past the vocabulary embeds as id 0, as in transformers (its rows are
        replaced anyway)."""
        image_token_id = getattr(self, "image_token_id", None)
        if image_token_id is not None and image_token_id >= self.config.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == image_token_id, 0)
        return self.model.embed(input_ids)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's crops -> its soft-token rows, flattened in order: pixel_values
        [3, H, W] or [crops, 3, H, W] (any leading dims are flattened), H = W = the
        tower's image_size -> [crops * mm_tokens_per_image, text hidden] in the model dtype."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise ValueError("this Gemma 3 checkpoint has no vision tower: it takes no images")
        pixel_values = pixel_values.reshape(-1, *pixel_values.shape[-3:])
        features = self.multi_modal_projector(self.vision_tower(pixel_values))
        return features.reshape(-1, features.shape[-1]).to(self.model.embed_tokens.weight.dtype)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Fill every parameter from the checkpoint's (name, tensor) pairs, streamed (names:
        `vision_weight_name`, `language_model_weights`). ValueError for a tensor with no
        place here, a shape mismatch, or a parameter left unfilled. No vision tensor at
        all: the model is served as text (`supports_images` False)."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            super().load_weights(weights)  # vision tensors, if any, are skipped
            return
        vision_params = {f"{prefix}.{name}": param
                         for prefix, module in (("vision_tower", self.vision_tower),
                                                ("multi_modal_projector",
                                                 self.multi_modal_projector))
                         for name, param in module.named_parameters()}
        filled: set[str] = set()

        def text_weights() -> Iterator[tuple[str, CheckpointTensor]]:
            """The checkpoint's other tensors; vision ones are copied in on the way (each
            as it streams by: a safetensors slice lives only while its file is open)."""
            for name, tensor in weights:
                target = vision_weight_name(name)
                if target is None:
                    yield name, tensor
                    continue
                if target.startswith(_UNUSED_VISION_PREFIXES):
                    continue
                if target not in vision_params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                     f"{type(self).__name__} (looked for {target!r})")
                with torch.no_grad():
                    copy_checked(vision_params[target], read_rows(tensor), name)
                filled.add(target)

        load_named_weights(_TextModel(self.model, self.lm_head),
                           language_model_weights(text_weights()),
                           skip_lm_head=self.tie_word_embeddings)
        if not filled:  # a text-only checkpoint of this architecture
            self.vision_tower = self.multi_modal_projector = None
            self.supports_images = False
            return
        missing = sorted(set(vision_params) - filled)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more"
                                              if len(missing) > 5 else "")
            raise ValueError(f"the checkpoint did not fill {len(missing)} vision "
                             f"parameter(s): {shown}")


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: local and global layers alternating (one RoPE base for both), no QK-norm,
    attention and final logits soft-capped."""

    QK_NORM = False


# Where a multimodal checkpoint keeps the language model (transformers 5, then 4.5x and
# 5's save_pretrained; the doubled ".model.model" of checkpoints saved by 5.10-5.23).
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.model.", "model."),
                            ("language_model.model.model.", "model."),
                            ("model.language_model.", "model."),
                            ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
# Where it keeps the vision tower and the projector -> our names: transformers 4.5x's
# (and the Hub's) vision_tower.vision_model.*, transformers 5's vision_tower.* in memory
# and on save; with or without the leading "model.".
_VISION_RENAMES = (("model.vision_tower.vision_model.", "vision_tower."),
                   ("vision_tower.vision_model.", "vision_tower."),
                   ("model.vision_tower.", "vision_tower."),
                   ("vision_tower.", "vision_tower."),
                   ("model.multi_modal_projector.", "multi_modal_projector."),
                   ("multi_modal_projector.", "multi_modal_projector."))
_VISION_PREFIXES = tuple(prefix for prefix, _ in _VISION_RENAMES)
# SigLIP's attention-pooling head (vision_use_head): in some checkpoints, read by nothing.
_UNUSED_VISION_PREFIXES = ("vision_tower.head.",)


def vision_weight_name(name: str) -> str | None:
    """A checkpoint tensor's name in our vision tower or projector, or None when it is
    not a vision tensor:

        vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight
            -> vision_tower.encoder.layers.0.mlp.fc1.weight
        model.multi_modal_projector.mm_input_projection_weight
            -> multi_modal_projector.mm_input_projection_weight
    """
    for prefix, ours in _VISION_RENAMES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return None


def language_model_weights(weights: Iterable[tuple[str, CheckpointTensor]]
                           ) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's language-model tensors under Gemma3ForCausalLM's names:

        model.language_model.layers.0.mlp.up_proj.weight -> model.layers.0.mlp.up_proj.weight
        model.vision_tower.* / multi_modal_projector.*    -> skipped
    """
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        yield name, tensor
