"""Fill a model's parameters from a GGUF file, its quantized tensors served in place.

    GGUF tensor (name, GGML type, bytes)          our model
    blk.3.attn_q.weight  Q4_K   ─ read, repack ─► layers.3.self_attn.qkv_proj piece 0:
                                                  QuantizedWeight int4 (super-block lanes)
    blk.3.attn_v.weight  Q6_K   ─ read, repack ─►                         piece 2:
                                                  QuantizedWeight int8 (six bits)
    blk.3.ffn_down.weight Q5_0  ─ read, repack ─► layers.3.mlp.down_proj:  QuantizedWeight int8
    blk.3.attn_norm.weight F32  ─ copy ─►   layers.3.input_layernorm.weight (dense)
    token_embd.weight    Q6_K   ─ read, repack ─► embed_tokens (rows decoded per lookup), and the
                                            tied lm_head's weight
    blk.3.attn_qkv.weight Q5_K  ─ mmap ─►   layers.3.self_attn.qkv_proj whole (Phi-3's fused
                                            tensors: rows already stacked q | k | v)

Quantized tensors become packed weights (engine.models.gguf_weight) and never exist as
dense floats: Q2_K/Q3_K/Q5_K and the types without an exact int4/int8 form stay the file's
memory-mapped bytes; Q4_0/Q4_1/Q8_0/Q5_0/IQ4_NL and Q4_K/Q6_K (with a multiple of 16
rows) are read once and repacked, exactly.
F32/F16/BF16 tensors (norms, biases, and linears stored unquantized) are copied into
the dense parameters. Llama's q/k rows, which llama.cpp's converter permutes for its
RoPE layout, are read into memory in HF's order (a copy of those two tensors only).

With `pack=False` (`--quantization none|int8|int4`, CUDA, tensor parallelism, or no C++
kernels) every tensor is dequantized into the dense parameters instead, as the user
asked or the platform needs; the caller says so in the log.

A vision-language model (a text GGUF with an `mmproj`: engine.model_loader.gguf_mmproj)
takes the text tensors into its text part (`model.*`, `lm_head`) exactly so, and its
vision tower and connector from the mmproj, dequantized.

A BERT embedding model (a `bert` GGUF: engine.model_loader.gguf_bert) has plain dense
linears (engine.models.bert): each tensor, Q8_0 or F16 alike, is dequantized into its
parameter in the model's dtype, under its HF checkpoint name (BertModel.load_weights).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine.model_loader.gguf import (
    check_tensors,
    has_rotary_permutation,
    hf_tensor_names,
    is_bert,
    norm_offset,
    unpermute_rotary_rows,
)
from engine.model_loader.gguf_file import GGUFFile
from engine.model_loader.gguf_mmproj import load_mmproj_weights
from engine.models.gguf_weight import (
    GGUFWeight,
    StackedWeight,
    concat_quantized,
    repack,
    repacks,
)
from engine.models.layers import Linear, MergedLinear, VocabEmbedding
from engine.models.phi3 import split_fused_weights
from engine.models.quant import QuantizedWeight
from engine.models.weight_utils import load_named_weights, map_weight_name

logger = logging.getLogger(__name__)

DENSE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass
class GGUFLoadReport:
    """What the load did with each tensor, for the start-up log and tests."""

    path: Path
    packed_types: Counter = field(default_factory=Counter)  # GGML type -> tensors kept packed
    repacked_types: Counter = field(default_factory=Counter)  # GGML type -> tensors repacked
    # GGML type -> quantized tensors dequantized into dense parameters (a BERT's)
    dequantized_types: Counter = field(default_factory=Counter)
    dense_tensors: int = 0
    packed_bytes: int = 0  # bytes the packed linears and tables hold
    mmproj: Path | None = None  # the vision projector the vision tensors came from
    vision_tensors: int = 0  # its tensors, dequantized into the vision tower

    def formats(self) -> str:
        """Example: "210 Q4_1 repacked, 1 Q8_0 repacked, 3 Q6_K as they are, 61 dense"
        (and ", 38 vision tensors dense (mmproj-smolvlm.gguf)" with an mmproj)."""
        parts = [f"{n} {t} as they are" for t, n in sorted(self.packed_types.items())]
        parts += [f"{n} {t} repacked" for t, n in sorted(self.repacked_types.items())]
        parts += [f"{n} {t} dequantized" for t, n in sorted(self.dequantized_types.items())]
        parts.append(f"{self.dense_tensors} dense tensors")
        if self.mmproj is not None:
            parts.append(f"{self.vision_tensors} vision tensors dense ({self.mmproj.name})")
        return ", ".join(parts)

    def summary(self) -> str:
        return (f"GGUF {self.path.name}: {self.formats()}; "
                f"{self.packed_bytes / 2**20:.1f} MiB of packed weights")


def load_gguf_weights(model: nn.Module, gguf_path: str | Path, pack: bool,
                      dtype: torch.dtype | None = None,
                      mmproj: str | Path | None = None) -> GGUFLoadReport:
    """Fill every parameter of `model` from the GGUF file (see the module docstring);
    `dtype`: the model's, for each packed kernel's few-row limit (quant.default_max_rows);
    `mmproj`: the vision projector that fills a vision-language model's vision parameters."""
    gguf = GGUFFile(gguf_path)
    check_tensors(gguf)
    report = GGUFLoadReport(Path(gguf_path))
    if is_bert(gguf):
        _load_bert_weights(model, gguf, report)
        return report
    config = model.config
    pieces: dict[str, dict[int | None, object]] = defaultdict(dict)  # module -> shard -> packed
    dense: list[tuple[str, torch.Tensor]] = []
    for gguf_name, hf_name in hf_tensor_names(gguf):
        info = gguf.tensors[gguf_name]
        heads = _rotary_heads(gguf, gguf_name, config)
        target, shard = map_weight_name(hf_name)
        module_name, _, leaf = target.rpartition(".")
        module = _submodule(model, module_name)
        if (pack and info.ggml_type not in DENSE_TYPES and leaf == "weight"
                and isinstance(module, (Linear, VocabEmbedding)) and len(info.shape) == 2):
            pieces[module_name][shard] = _packed(gguf, gguf_name, heads, report, dtype)
            continue
        if "{expert}" in hf_name:
            for expert, weights in enumerate(gguf.load(gguf_name)):
                dense.append((hf_name.format(expert=expert),
                              torch.from_numpy(np.ascontiguousarray(weights))))
        else:
            array = gguf.load(gguf_name)
            if heads is not None:
                array = unpermute_rotary_rows(array, heads)
            offset = norm_offset(gguf, gguf_name)
            if offset:  # the model adds it back as it loads (OffsetRMSNorm)
                array = array.astype(np.float32) - offset
            dense.append((hf_name, torch.from_numpy(array)))
        report.dense_tensors += 1
    for module_name, shards in pieces.items():
        packed = _assemble(model.get_submodule(module_name), module_name, shards)
        report.packed_bytes += packed.num_bytes
        model.get_submodule(module_name).set_packed(packed)
    if getattr(model, "tie_word_embeddings", False):
        embed = model.model.embed_tokens
        if embed.packed is not None:
            model.lm_head.set_packed(embed.packed)
    # Dense fused tensors (Phi-3's, unquantized or with pack=False) go in as their q/k/v and
    # gate/up pieces, so tensor parallelism can cut each piece like any checkpoint's.
    load_named_weights(model if mmproj is None else _TextPart(model),
                       split_fused_weights(config, dense),
                       skip_lm_head=getattr(model, "tie_word_embeddings", False))
    if mmproj is not None:
        report.mmproj = Path(mmproj)
        report.vision_tensors = load_mmproj_weights(model, mmproj)
    return report


def _load_bert_weights(model: nn.Module, gguf: GGUFFile, report: GGUFLoadReport) -> None:
    """Every tensor dequantized (float32, then the parameter's dtype as it is copied) under
    its HF name: 'blk.0.attn_q.weight' -> 'encoder.layer.0.attention.self.query.weight'."""
    def tensors():
        for gguf_name, hf_name in hf_tensor_names(gguf):
            info = gguf.tensors[gguf_name]
            if info.ggml_type in DENSE_TYPES:
                report.dense_tensors += 1
            else:
                report.dequantized_types[info.ggml_type.name] += 1
            yield hf_name, torch.from_numpy(gguf.load(gguf_name))

    model.load_weights(tensors())


class _TextPart(nn.Module):
    """A vision-language model's text decoder and lm_head seen alone (the same modules), so
    that load_named_weights fills and checks exactly the text GGUF's parameters."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.model
        self.lm_head = model.lm_head


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None  # load_named_weights reports the tensor with no place


def _rotary_heads(gguf: GGUFFile, gguf_name: str, config) -> int | None:
    """Heads of the q/k tensor whose rows llama.cpp permuted, else None."""
    if not has_rotary_permutation(gguf, gguf_name):
        return None
    if ".attn_q." in gguf_name:
        return config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _packed(gguf: GGUFFile, name: str, heads: int | None, report: GGUFLoadReport,
            dtype: torch.dtype | None):
    """The packed weight of one quantized 2-D tensor."""
    info = gguf.tensors[name]
    repacked = repacks(info.ggml_type, info.shape[0])
    if repacked or heads is not None:
        raw = gguf.read(name)  # into memory, not mapped: the mapping's pages stay untouched
        if heads is not None:
            raw = unpermute_rotary_rows(raw, heads)  # whole rows of blocks move
    else:
        raw = gguf.raw(name)
    if repacked:
        report.repacked_types[info.ggml_type.name] += 1
        return repack(raw, info.ggml_type, dtype=dtype)
    report.packed_types[info.ggml_type.name] += 1
    with warnings.catch_warnings():  # the mapping is read-only; no kernel writes to it
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(raw)
    return GGUFWeight(tensor, info.ggml_type, info.shape[-1], dtype=dtype)


def _assemble(module: nn.Module, module_name: str, shards: dict[int | None, object]):
    """One packed weight for the module from its pieces (q, k, v / gate, up / whole)."""
    if isinstance(module, MergedLinear) and list(shards) == [None]:
        return shards[None]  # a fused tensor (Phi-3): check_tensors checked its rows
    expected = list(range(len(module.output_sizes))) if isinstance(module, MergedLinear) else [None]
    if sorted(shards, key=lambda s: -1 if s is None else s) != expected:
        raise ValueError(f"{module_name}: the GGUF file has pieces {sorted(map(str, shards))} "
                         f"of it, expected {[str(s) for s in expected]}")
    parts = [shards[s] for s in expected]
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, QuantizedWeight) and p.spec == parts[0].spec
           and p.scale_form == parts[0].scale_form for p in parts):
        return concat_quantized(parts)
    return StackedWeight(parts)
