"""Llama (and the decoder shared by Qwen2/Qwen3/Qwen3-MoE, which differ in flags).

Layout, per token (T tokens of any number of requests, flattened):

    embed_tokens -> [ input_layernorm -> self_attn -> +residual
                      post_attention_layernorm -> mlp -> +residual ] x L
                 -> norm -> (compute_logits) lm_head

Each "+residual" is folded into the norm that follows it (`RMSNorm(x, residual)`):
a layer returns its MLP output and the residual stream separately, so the add and
the next norm are one fused op on the CPU.

Module names mirror the HF checkpoint's, except that q/k/v live in one
`qkv_proj` and gate/up in one `gate_up_proj` (filled shard by shard at load).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.attention import Attention
from engine.distributed.parallel_state import get_tp_group
from engine.distributed.sharding import shard_heads
from engine.models.fused_decoder import STEPS_RUN, FusedDecoderStack
from engine.models.layers import (
    GatedMLP,
    LMHead,
    MergedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabEmbedding,
)
from engine.models.rotary import RotaryEmbedding, apply_rotary_qk
from engine.models.weight_utils import load_named_weights
from engine.openmp import small_ops_on_this_thread


def head_size_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config: Any, layer_idx: int) -> int | None:
    """Layer `layer_idx`'s sliding window (tokens each query sees), or None for full
    attention. `layer_types` (transformers 5: Gemma 3, Qwen2, ...) names each layer's
    kind; without it a `sliding_window` applies to every layer (Mistral, Phi-3) unless
    `use_sliding_window` is off."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    # A window at least as long as the context is full attention (Phi-3.5's 262144).
    if window >= getattr(config, "max_position_embeddings", window + 1):
        return None
    return int(window)


class DecoderAttention(nn.Module):
    """Self-attention: fused qkv, optional per-head q/k RMSNorm (Qwen3), RoPE, paged attention.

    Tensor-parallel: each rank computes its own query heads and the KV heads they read
    (`shard_heads`); `num_heads` / `num_kv_heads` are this rank's, and o_proj sums the
    ranks' partial outputs.
    """

    def __init__(self, config: Any, *, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 sliding_window: int | None = None, scale: float | None = None,
                 norm_class: type[RMSNorm] = RMSNorm, logit_softcap: float | None = None):
        super().__init__()
        tp = get_tp_group()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_size = head_size_of(config)
        heads = shard_heads(total_heads, total_kv_heads, self.head_size, tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        q_size = total_heads * self.head_size
        kv_size = total_kv_heads * self.head_size
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias,
                                     row_ranges=[heads.q_rows, heads.kv_rows, heads.kv_rows])
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=o_bias,
                                        col_range=heads.q_rows)
        if qk_norm:
            self.q_norm = norm_class(self.head_size, eps=config.rms_norm_eps)
            self.k_norm = norm_class(self.head_size, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads,
                              scale=scale or self.head_size**-0.5, sliding_window=sliding_window,
                              logit_softcap=logit_softcap)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv_proj.forward_split(hidden_states)
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_qk(q, k, cos, sin)
        out = self.attn(q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, attention: DecoderAttention, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous layer's output, residual stream) -> (this layer's MLP output, stream).

        The first layer gets residual None: its input is the stream. The inputs may be
        overwritten (the fused norms work in place).
        """
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(hidden_states, cos, sin)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class DecoderModel(nn.Module):
    """embed -> layers -> final norm; `make_layer(i)` builds layer i."""

    def __init__(self, config: Any, make_layer):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding.from_config(config, head_size_of(config))
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # The layers as one C++ call on the CPU (engine.models.fused_decoder), built on
        # the first step that runs with a KV cache (weights loaded and quantized by then).
        self._fused: FusedDecoderStack | None | bool = False  # False: not built yet

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size].

        `inputs_embeds` [T, hidden_size] (a vision-language model's token embeddings with
        image rows written in) replaces `embed_tokens(input_ids)`; it may be overwritten.
        """
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary_emb(positions)
        fused = self._fused_stack()
        result = None if fused is None else fused.run(hidden_states, cos, sin)
        if result is not None:
            STEPS_RUN["fused"] += 1
            return self.norm(*result)[0]
        STEPS_RUN["modules"] += 1
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos, sin)
        return self.norm(hidden_states, residual)[0]

    def _fused_stack(self) -> FusedDecoderStack | None:
        if self._fused is False and self.layers[0].self_attn.attn.kv_cache is not None:
            self._fused = FusedDecoderStack.build(self.layers)
        return self._fused or None


class DecoderForCausalLM(nn.Module):
    """The contract every model implements (see `engine.models`).

    Subclasses choose the attention flags and the MLP of each layer through
    `make_attention` / `make_mlp`.
    """

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.model = DecoderModel(
            config,
            lambda i: DecoderLayer(config, self.make_attention(config, i), self.make_mlp(config, i)),
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.make_head(config)

    def make_head(self, config: Any) -> None:
        """The output head: the lm_head (a sequence classifier's score head instead:
        engine/models/sequence_classification.py)."""
        # A tied lm_head is a Linear over the embedding's own parameter (one tensor in
        # memory), so it can be quantized like any other linear.
        tied = self.model.embed_tokens.weight if self.tie_word_embeddings else None
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, weight=tied)

    def make_attention(self, config: Any, layer_idx: int) -> DecoderAttention:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderAttention(config, qkv_bias=bias, o_bias=bias, qk_norm=False,
                                sliding_window=layer_sliding_window(config, layer_idx))

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size,
                        bias=bool(getattr(config, "mlp_bias", False)),
                        hidden_act=getattr(config, "hidden_act", "silu"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] long -> final hidden states [T, hidden_size];
        `inputs_embeds` [T, hidden_size], if given, replaces the token embeddings."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N, vocab_size] float32."""
        logits = self.lm_head(hidden_states)
        with small_ops_on_this_thread(logits):
            return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill every parameter from (HF checkpoint name, tensor) pairs, streamed.

        Raises ValueError for a tensor the model has no place for, a shape
        mismatch, or a parameter the checkpoint left unfilled.
        """
        load_named_weights(self, weights, skip_lm_head=self.tie_word_embeddings)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 2/3, SmolLM, and other Llama-architecture checkpoints."""



class MistralForCausalLM(DecoderForCausalLM):
    """Mistral / Ministral: the Llama decoder, with `sliding_window` on every layer if set."""
