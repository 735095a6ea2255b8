"""Gemma 3 (text): `Gemma3ForCausalLM`, and the language model of
`Gemma3ForConditionalGeneration` checkpoints (the vision tower is not loaded); and Gemma 2
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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.models.checkpoint_tensor import CheckpointTensor
from engine.models.layers import GatedMLP, LMHead, OffsetRMSNorm, VocabEmbedding
from engine.models.llama import DecoderAttention, layer_sliding_window
from engine.models.rotary import RotaryEmbedding
from engine.models.weight_utils import load_named_weights

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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        # transformers rounds the scale to the weights' dtype before multiplying.
        hidden_states = hidden_states * torch.tensor(self.embed_scale, dtype=hidden_states.dtype)
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

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states).float()
        cap = self.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        load_named_weights(self, language_model_weights(weights),
                           skip_lm_head=self.tie_word_embeddings)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A multimodal Gemma 3 checkpoint served as text: its language model only."""


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2: local and global layers alternating (one RoPE base for both), no QK-norm,
    attention and final logits soft-capped."""

    QK_NORM = False


# Where a multimodal checkpoint keeps the language model (transformers 5, then 4.5x).
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."),
                            ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                    "multi_modal_projector.")


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
