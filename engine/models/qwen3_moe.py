"""Qwen3-MoE: Qwen3 attention; sparse MoE MLPs on the layers the config marks sparse."""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.layers import GatedMLP
from engine.models.moe import SparseMoeBlock
from engine.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """HF's rule: sparse unless listed in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and num_experts > 0
        and (layer_idx + 1) % step == 0
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size,
                            hidden_act=getattr(config, "hidden_act", "silu"))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported expert activation {config.hidden_act!r} (only 'silu')")
        return SparseMoeBlock(
            config.hidden_size,
            num_experts=getattr(config, "num_experts", None) or config.num_local_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
        )
