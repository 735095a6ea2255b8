"""`--quantization`: which linears of a loaded model run in int8/int4, and doing it.

    none   every linear dense, in the compute dtype
    int8   every linear (lm_head included) int8, symmetric, in groups of 32 columns
    int4   every linear int4, asymmetric (min + scale * q), in groups of 32 columns
    auto   a GGUF checkpoint keeps its own precision, tensor by tensor, exactly:
           Q4_1 -> int4 asymmetric (its min is the zero point), Q4_0 -> int4
           symmetric, Q8_0 -> int8; other types and non-GGUF checkpoints stay dense

Quantized kernels exist for the CPU only; on CUDA `auto` means none.
The GGUF converter records each tensor's type in `gguf_tensor_types.json`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.model_loader.gguf import GGUF_TYPES_FILE
from engine.models.layers import Linear
from engine.models.quant import QuantSpec
from engine.models.weight_utils import map_weight_name

logger = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
_GGUF_TYPE_SPECS = {"Q4_0": QuantSpec("int4", symmetric=True), "Q4_1": QuantSpec("int4"),
                    "Q8_0": QuantSpec("int8")}


@dataclass
class QuantizationReport:
    """What `quantize_model` did, for the start-up log and tests."""

    requested: str
    specs: dict[str, QuantSpec] = field(default_factory=dict)  # module name -> spec
    dense_modules: list[str] = field(default_factory=list)  # linears left dense
    quantized_bytes: int = 0  # bytes the quantized kernels read per full pass
    dense_bytes: int = 0  # bytes of the linears left dense

    def summary(self) -> str:
        if not self.specs:
            return f"quantization {self.requested}: all linears dense"
        kinds = sorted({s.method + ("-sym" if s.symmetric else "") for s in self.specs.values()})
        return (f"quantization {self.requested}: {len(self.specs)} linears {'+'.join(kinds)} "
                f"({self.quantized_bytes / 2**20:.1f} MiB read per small-batch step), "
                f"{len(self.dense_modules)} dense ({self.dense_bytes / 2**20:.1f} MiB)")


def plan_quantization(model: nn.Module, requested: str, model_dir: str | Path | None,
                      device: torch.device | str) -> dict[str, QuantSpec | None]:
    """Module name -> the spec its Linear gets (None: dense), for every Linear of `model`."""
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {requested!r}; choose "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    linears = [name for name, m in model.named_modules() if isinstance(m, Linear)]
    if requested == "none" or (requested == "auto" and torch.device(device).type != "cpu"):
        return dict.fromkeys(linears)
    if requested in ("int8", "int4"):
        if torch.device(device).type != "cpu":
            raise ValueError(f"--quantization {requested} runs on the CPU only (the C++ "
                             "kernels of kernels/cpu/quant_linear.cpp); on CUDA use --quantization none")
        spec = QuantSpec(requested)
        return dict.fromkeys(linears, spec)
    gguf_types = _read_gguf_types(model_dir)
    if not gguf_types:
        return dict.fromkeys(linears)
    return {name: _spec_from_gguf(model, name, gguf_types) for name in linears}


def quantize_model(model: nn.Module, requested: str = "auto",
                   model_dir: str | Path | None = None, device: torch.device | str = "cpu",
                   max_rows: int | None = None) -> QuantizationReport:
    """Quantize the loaded model's linears as planned; returns what was done."""
    report = QuantizationReport(requested)
    for name, spec in plan_quantization(model, requested, model_dir, device).items():
        layer = model.get_submodule(name)
        if spec is not None and layer.quantize(spec, max_rows):
            report.specs[name] = spec
            report.quantized_bytes += layer.quantized.num_bytes
        else:
            if spec is not None:
                logger.info("%s [%d x %d]: in_features is not a multiple of 32, left dense",
                            name, layer.out_features, layer.in_features)
            report.dense_modules.append(name)
            report.dense_bytes += layer.weight.numel() * layer.weight.element_size()
    return report


def _read_gguf_types(model_dir: str | Path | None) -> dict[str, str]:
    if model_dir is None:
        return {}
    path = Path(model_dir) / GGUF_TYPES_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _spec_from_gguf(model: nn.Module, module_name: str, gguf_types: dict[str, str]
                    ) -> QuantSpec | None:
    """The spec of a module from the GGUF types of the checkpoint tensors that fill it.

    A fused module (qkv_proj from q/k/v) is quantized only if all its pieces agree.
    A tied lm_head takes the type of the embedding it shares.
    """
    target = f"{module_name}.weight"
    if module_name == "lm_head" and getattr(model, "tie_word_embeddings", False):
        target = "model.embed_tokens.weight"
    sources = {t for hf_name, t in gguf_types.items() if map_weight_name(hf_name)[0] == target}
    if len(sources) != 1:
        return None
    return _GGUF_TYPE_SPECS.get(sources.pop())
