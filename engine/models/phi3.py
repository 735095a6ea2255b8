"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder, with q/k/v and gate/up fused in the
checkpoint, LongRoPE scaling (engine.models.rotary), and on some (Phi-3-mini-4k) a
sliding window on every layer.

The checkpoint's fused tensors are split into their pieces as they load, so each piece
lands in its shard of our own fused layers, and tensor parallelism cuts them like any
Llama's:

    model.layers.0.self_attn.qkv_proj.weight [q + 2 kv, H]
        -> rows [0, q) as q_proj, [q, q + kv) as k_proj, [q + kv, q + 2 kv) as v_proj
    model.layers.0.mlp.gate_up_proj.weight [2 I, H]
        -> rows [0, I) as gate_proj, [I, 2 I) as up_proj
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from engine.models.checkpoint_tensor import CheckpointTensor, read_rows
from engine.models.llama import DecoderForCausalLM, head_size_of
from engine.models.weight_utils import load_named_weights


class Phi3ForCausalLM(DecoderForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        load_named_weights(self, split_fused_weights(self.config, weights),
                           skip_lm_head=self.tie_word_embeddings)


def split_fused_weights(config, weights: Iterable[tuple[str, CheckpointTensor]]
                        ) -> Iterator[tuple[str, CheckpointTensor]]:
    """Phi-3's fused qkv_proj / gate_up_proj tensors as the separate HF pieces."""
    head_size = head_size_of(config)
    q_size = config.num_attention_heads * head_size
    kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) \
        * head_size
    for name, tensor in weights:
        if name.endswith("self_attn.qkv_proj.weight"):
            yield from _split(name, "qkv_proj", read_rows(tensor),
                              [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)])
        elif name.endswith("mlp.gate_up_proj.weight"):
            size = config.intermediate_size
            yield from _split(name, "gate_up_proj", read_rows(tensor),
                              [("gate_proj", size), ("up_proj", size)])
        else:
            yield name, tensor


def _split(name: str, fused: str, tensor: torch.Tensor, pieces: list[tuple[str, int]]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    total = sum(size for _, size in pieces)
    if tensor.shape[0] != total:
        raise ValueError(f"{name}: {tensor.shape[0]} rows, expected {total} "
                         f"({' + '.join(f'{p} {n}' for p, n in pieces)})")
    start = 0
    for piece, size in pieces:
        yield name.replace(fused, piece), tensor.narrow(0, start, size)
        start += size
