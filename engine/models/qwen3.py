"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from typing import Any

from engine.models.llama import DecoderAttention, DecoderForCausalLM, layer_sliding_window


class Qwen3ForCausalLM(DecoderForCausalLM):
    def make_attention(self, config: Any, layer_idx: int) -> DecoderAttention:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderAttention(config, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                sliding_window=layer_sliding_window(config, layer_idx))
