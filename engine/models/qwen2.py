"""Qwen2 / Qwen2.5: the Llama decoder with biases on q/k/v (none on o_proj or the MLP)."""

from __future__ import annotations

from typing import Any

from engine.models.llama import DecoderAttention, DecoderForCausalLM, layer_sliding_window


class Qwen2ForCausalLM(DecoderForCausalLM):
    def make_attention(self, config: Any, layer_idx: int) -> DecoderAttention:
        return DecoderAttention(config, qkv_bias=True, o_bias=False, qk_norm=False,
                                sliding_window=layer_sliding_window(config, layer_idx))
