"""Building blocks shared by the models: norms, linears, activations, embeddings.

Every parameter is allocated with `torch.empty` (no random init: the checkpoint
fills it) in the default dtype/device the loader sets, with requires_grad off.
Fused layers (`MergedLinear`, `FusedExperts`) take their checkpoint pieces one
at a time through `load_shard`, so a loader can stream tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.quant import QuantizedWeight, QuantSpec, can_quantize, quantize
from kernels.cpu_kernels import fused_ops_for


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst.copy_(src) (casting dtype/device), after checking the shapes agree."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32 over the last dim.

    With `residual`, the residual add comes first and both results return:
    `norm(x, residual)` -> (rms_norm(x + residual), x + residual), the pair a decoder
    layer passes on. On the CPU, 2-D inputs take one fused C++ call (which overwrites
    x and residual with those results); `forward_torch` is the reference.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        ops = fused_ops_for(x) if x.dim() == 2 else None
        if ops is None:
            return self.forward_torch(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight, self.eps)
            return out
        ops.add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual

    def forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            residual = x + residual
            return self.forward_torch(residual), residual
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features] as in HF checkpoints.

    After `quantize(spec)` the layer also holds its weight in int8/int4 and runs the
    quantized kernel for batches of up to `quantized.max_rows` rows; `weight` then
    holds the dequantized values, used for larger batches (see engine.models.quant).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 weight: nn.Parameter | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # `weight` given: share another module's parameter (a tied lm_head).
        self.weight = empty_param(out_features, in_features) if weight is None else weight
        self.bias = empty_param(out_features) if bias else None
        self.quantized: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None and self.quantized.serves(x.shape[0]):
            return self.quantized.matmul(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def quantize(self, spec: QuantSpec, max_rows: int | None = None) -> bool:
        """Quantize the loaded weight in place; False (and unchanged) if the shape does not suit."""
        if not can_quantize(self.out_features, self.in_features):
            return False
        self.quantized = quantize(self.weight.data, spec, max_rows)
        with torch.no_grad():
            self.weight.copy_(self.quantized.dequantized())
        return True


class MergedLinear(Linear):
    """Several linears over the same input, stacked along the output dim: one matmul.

    output_sizes [q, k, v] -> weight rows [0, q) | [q, q+k) | [q+k, q+k+v).
    The checkpoint's pieces arrive one at a time as shard 0, 1, 2, ...
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: int) -> None:
        param = getattr(self, param_name)
        rows = param.narrow(0, self.offsets[shard], self.output_sizes[shard])
        copy_checked(rows, tensor, f"{param_name} shard {shard}")

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of each merged linear, as views of one matmul's result."""
        return self(x).split(self.output_sizes, dim=-1)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; doubles as a tied lm_head."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = empty_param(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class SiluAndMul(nn.Module):
    """x [..., 2I] = [gate | up] -> silu(gate) * up, [..., I] (one C++ call on the CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x) if x.dim() == 2 else None
        if ops is None:
            return self.forward_torch(x)
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        ops.silu_and_mul(out, x)
        return out

    @staticmethod
    def forward_torch(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into `gate_up_proj`."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported MLP activation {hidden_act!r} (only 'silu')")
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
