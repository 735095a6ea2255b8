"""`--quantization`: which linears of a loaded model run in int8/int4, and doing it.

    none   every linear dense, in the compute dtype (a GGUF file: dequantized at load)
    int8   every linear (lm_head included) int8, symmetric, in groups of 32 columns
    int4   every linear int4, asymmetric (min + scale * q), in groups of 32 columns
    auto   a GGUF file keeps its own formats, tensor by tensor, read in place
           (engine.model_loader.gguf_weights); a safetensors checkpoint stays dense

A quantized linear drops its dense weight; a tied embedding then looks its rows up in
the lm_head's quantized table. Quantized kernels exist for the CPU only; on CUDA
`auto` means none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.models.layers import Linear
from engine.models.quant import QuantSpec

logger = logging.getLogger(__name__)

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


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


def plan_quantization(model: nn.Module, requested: str, device: torch.device | str
                      ) -> dict[str, QuantSpec | None]:
    """Module name -> the spec its Linear gets (None: dense), for every Linear of `model`."""
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"unknown quantization {requested!r}; choose "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    linears = [name for name, m in model.named_modules() if isinstance(m, Linear)]
    if requested in ("none", "auto"):
        return dict.fromkeys(linears)
    if requested in ("int8", "int4"):
        if torch.device(device).type != "cpu":
            raise ValueError(f"--quantization {requested} runs on the CPU only (the C++ "
                             "kernels of pagedserve_kernels/cpu/quant_linear.cpp); on CUDA use --quantization none")
    return dict.fromkeys(linears, QuantSpec(requested))


def quantize_model(model: nn.Module, requested: str = "auto",
                   device: torch.device | str = "cpu", max_rows: int | None = None,
                   dtype: torch.dtype | None = None) -> QuantizationReport:
    """Quantize the loaded model's linears as planned; returns what was done. `dtype`: the
    model's, for each kernel's few-row limit (engine.models.quant.default_max_rows)."""
    report = QuantizationReport(requested)
    for name, spec in plan_quantization(model, requested, device).items():
        layer = model.get_submodule(name)
        if spec is not None and layer.quantize(spec, max_rows, dtype):
            report.specs[name] = spec
            report.quantized_bytes += layer.quantized.num_bytes
        else:
            if spec is not None:
                logger.info("%s [%d x %d]: in_features is not a multiple of 32, left dense",
                            name, layer.out_features, layer.in_features)
            report.dense_modules.append(name)
            report.dense_bytes += layer.weight.numel() * layer.weight.element_size()
    share_tied_table(model)
    return report


def share_tied_table(model: nn.Module) -> None:
    """A tied embedding whose lm_head is packed looks its rows up in that packed table."""
    lm_head = getattr(model, "lm_head", None)
    if getattr(model, "tie_word_embeddings", False) and getattr(lm_head, "quantized", None):
        model.model.embed_tokens.set_packed(lm_head.quantized)
