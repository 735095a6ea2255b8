"""A dense decoder's layers as one C++ call per CPU step (`pagedserve_kernels/cpu/decoder_stack.cpp`).

At one client a SmolLM2 decode step spends about as long in the interpreter between
the kernels (~40 Python-level calls per layer: module calls, views, the attention
backend's checks) as in its int4 matmuls. The stack runs the same kernels in the same
order on the same tensors from C++, so its output is bitwise the modules' (tested);
the modules stay the reference and run every step the stack declines:

- built only for models whose layers are all `DecoderLayer`s with a `GatedMLP` (Llama,
  Qwen2, Qwen3, Mistral and Phi-3 without a sliding window; not MoE, not Gemma 3), CPU weights of one dtype (float32, bfloat16 or float16),
  one rank (no tensor parallelism), with the C++ kernels built;
- taken only for steps whose every token is a row of the in-place attention kernel
  (decodes and short prompt chunks, no SDPA prefill), with a cache the kernel reads.

With LoRA adapters (--enable-lora) the stack adds each linear's side path as the modules
do (the same lora_add_ call on the same tensors): it is handed an adapter's matrices
the first step that adapter runs, and again whenever the linears' copies change.

`PAGEDSERVE_FUSED_DECODER=0` turns it off (the modules then run every step).
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch import nn

from engine import batch_invariant
from engine.attention.backends.torch_backend import KERNEL_DTYPES, TorchAttentionBackend
from engine.attention.forward_context import LoRAMapping, get_forward_context
from engine.distributed.parallel_state import get_tp_group
from engine.models.gguf_weight import GGUFWeight, StackedWeight
from engine.models.layers import GatedMLP, Linear
from engine.models.quant import ALL_ROWS, KERNEL_CALLS
from pagedserve_kernels.cpu_kernels import cpu_kernels

STEPS_RUN: Counter[str] = Counter()  # "fused" / "modules": which path ran each step


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_FUSED_DECODER", "1") != "0"


class FusedDecoderStack:
    """The C++ stack of one model's layers and the quantized-kernel calls it makes."""

    def __init__(self, stack, layers: nn.ModuleList, quantized: list[tuple[int, int]]):
        self._stack = stack
        # Each layer's four linears (qkv, o, gate_up, down: the stack's order), whose
        # `lora` holds the adapters' matrices; lora_id -> the serials handed to the stack.
        self._linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                          layer.mlp.gate_up_proj, layer.mlp.down_proj) for layer in layers]
        self._lora_serials: dict[int, tuple[int, ...]] = {}
        # Bound once by the model runner before the first step that builds the stack.
        self._kv_caches = [layer.self_attn.attn.kv_cache for layer in layers]
        self._head_size = layers[0].self_attn.head_size
        self._dtype = layers[0].input_layernorm.weight.dtype
        # (kernel name, max_rows) -> how many packed weights have it: what KERNEL_CALLS counts
        self._quantized = Counter(quantized)

    @classmethod
    def build(cls, layers: nn.ModuleList) -> FusedDecoderStack | None:
        """The stack over `layers` (their loaded, quantized weights, shared not copied),
        or None where the model or the machine does not suit it."""
        if not enabled() or get_tp_group().size != 1 or len(layers) == 0:
            return None
        first = layers[0].self_attn
        dtype = layers[0].input_layernorm.weight.dtype
        if dtype not in KERNEL_DTYPES or not all(_suits(layer, dtype) for layer in layers):
            return None
        ops = cpu_kernels()  # after the checks: a GPU model never builds the CPU kernels
        if ops is None:
            return None
        shape = ops.DecoderShape()
        shape.num_heads, shape.num_kv_heads = first.num_heads, first.num_kv_heads
        shape.head_size = first.head_size
        shape.rms_norm_eps = layers[0].input_layernorm.eps
        shape.attention_scale = first.attn.scale
        weights, quantized = [], []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            w = ops.LayerWeights()
            w.input_norm = layer.input_layernorm.weight.data
            w.post_attention_norm = layer.post_attention_layernorm.weight.data
            if attn.q_norm is not None:
                w.q_norm, w.k_norm = attn.q_norm.weight.data, attn.k_norm.weight.data
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            w.qkv, w.o, w.gate_up, w.down = (_linear_weights(ops, lin, quantized)
                                             for lin in linears)
            weights.append(w)
        return cls(ops.DecoderStack(weights, shape), layers, quantized)

    def run(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embeddings [T, hidden], RoPE cos/sin) -> (last MLP output, residual stream),
        or None when this step is not one the stack takes (the caller runs the modules)."""
        context = get_forward_context()
        backend, metadata = context.backend, context.attn_metadata
        if (not isinstance(backend, TorchAttentionBackend)
                or hidden_states.dtype != self._dtype or not hidden_states.is_contiguous()
                or not backend.kernel_fits(hidden_states.dtype, self._head_size,
                                           self._kv_caches[0])
                or hidden_states.shape[0] != metadata.num_actual_tokens
                or metadata.block_table.dtype != torch.int32
                or metadata.slot_mapping.dtype != torch.int64):
            return None
        rows = backend.kernel_rows(metadata)
        if rows.token_idx is not None or len(rows.sdpa_reqs):
            return None  # some tokens are not kernel rows (an SDPA prefill)
        num_tokens = hidden_states.shape[0]
        self._count_kernel_calls(num_tokens)
        lora_ids, lora_rows = self._lora_groups(context.lora)
        return self._stack.forward(hidden_states, cos, sin, self._kv_caches,
                                   metadata.slot_mapping[:num_tokens].contiguous(),
                                   metadata.block_table, rows.row_tables, rows.seq_lens,
                                   lora_ids, lora_rows)

    def _lora_groups(self, mapping: LoRAMapping | None
                     ) -> tuple[list[int], list[torch.Tensor]]:
        """The step's adapter groups as the stack takes them (rows empty: every token),
        each adapter's matrices handed over first where the stack's are missing or stale."""
        if mapping is None:
            return [], []
        for lora_id, _ in mapping.groups:
            serials = self._serials(lora_id)
            if self._lora_serials.get(lora_id) != serials:
                self._hand_over(lora_id)
                self._lora_serials[lora_id] = serials
        empty = torch.empty(0, dtype=torch.int64)
        return ([lora_id for lora_id, _ in mapping.groups],
                [empty if rows is None else rows for _, rows in mapping.groups])

    def _serials(self, lora_id: int) -> tuple[int, ...]:
        """Which copy of the adapter each linear holds (-1: none), to tell a reload."""
        return tuple(adapted.serial if (adapted := linear.lora.adapters.get(lora_id)) else -1
                     for linears in self._linears for linear in linears
                     if linear.lora is not None)

    def _hand_over(self, lora_id: int) -> None:
        self._stack.drop_lora(lora_id)
        # Adapters the linears no longer hold are forgotten too (their memory freed).
        for stale in [i for i in self._lora_serials if max(self._serials(i)) < 0]:
            self._stack.drop_lora(stale)
            del self._lora_serials[stale]
        ops = cpu_kernels()
        for layer_index, linears in enumerate(self._linears):
            for linear_index, linear in enumerate(linears):
                adapted = linear.lora.adapters.get(lora_id) if linear.lora is not None else None
                if adapted is not None:
                    weights = ops.LoRAWeights()
                    weights.a, weights.b_t = adapted.a_stacked, adapted.b_t
                    weights.pieces = adapted.pieces
                    self._stack.set_lora(lora_id, layer_index, linear_index, weights)

    def _count_kernel_calls(self, num_rows: int) -> None:
        for (kernel, max_rows), count in self._quantized.items():
            KERNEL_CALLS[kernel if num_rows <= max_rows else "tiled"] += count


def _suits(layer: nn.Module, dtype: torch.dtype) -> bool:
    # `layer` is a DecoderLayer (engine.models.llama builds the stack over its own layers).
    if not isinstance(layer.mlp, GatedMLP):
        return False
    attn = layer.self_attn
    if attn.head_size * attn.num_heads != attn.qkv_proj.output_sizes[0]:
        return False
    if attn.attn.sliding_window is not None or attn.attn.logit_softcap:
        return False  # the stack attends to every key, with plain softmax scores
    eps = layer.input_layernorm.eps  # the stack uses one eps for every norm
    if (layer.post_attention_layernorm.eps != eps
            or (attn.q_norm is not None and not attn.q_norm.eps == attn.k_norm.eps == eps)):
        return False
    return all(param.dtype == dtype and param.device.type == "cpu"
               for param in layer.parameters())


def _linear_weights(ops, linear: Linear, counted: list[tuple[str, int]]):
    """The C++ view of `linear` (its tensors shared, not copied); appends (kernel name,
    max_rows) of each packed weight to `counted`."""
    w = _packed_weights(ops, linear.quantized, counted) if linear.quantized is not None \
        else ops.LinearWeights()
    w.dense = linear.weight.data
    if linear.bias is not None:
        w.bias = linear.bias.data
    return w


def _packed_weights(ops, packed, counted: list[tuple[str, int]]):
    w = ops.LinearWeights()
    if isinstance(packed, StackedWeight):
        w.parts = [_packed_weights(ops, part, counted) for part in packed.parts]
        return w
    # Batch invariant: every batch on the few-row kernel (as packed.serves says).
    w.quant_max_rows = ALL_ROWS if batch_invariant.enabled() else packed.max_rows
    if isinstance(packed, GGUFWeight):
        w.gguf_type, w.data = int(packed.ggml_type), packed.raw
        counted.append((packed.ggml_type.name, w.quant_max_rows))
        return w
    w.quant_bits = 4 if packed.spec.method == "int4" else 8
    w.data, w.scales = packed.data, packed.scales
    if packed.mins is not None:
        w.mins = packed.mins
    counted.append((packed.spec.method, w.quant_max_rows))
    return w
