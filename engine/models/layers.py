"""Building blocks shared by the models: norms, linears, activations, embeddings.

Every parameter is allocated with `torch.empty` (no random init: the checkpoint
fills it) in the default dtype/device the loader sets, with requires_grad off.
Fused layers (`MergedLinear`, `FusedExperts`) take their checkpoint pieces one
at a time through `load_shard`, so a loader can stream tensors.

Tensor parallelism (engine.distributed) sits behind the same names: each layer reads
the group at construction and holds only its rank's shard, which `load_shard` reads
from the checkpoint (rows or columns; see engine.distributed.sharding):

    Linear         replicated: every rank holds all of it (a MoE router)
    MergedLinear   column-parallel: each rank its rows of every merged piece (qkv, gate_up)
    RowParallelLinear  each rank its input columns; the partial outputs are all-reduced
    VocabEmbedding     each rank its vocabulary rows; lookups outside them are 0, all-reduced
    LMHead         each rank its vocabulary rows; logits all-gathered, padding cut off

With one rank every layer is the plain dense one. Quantization composes: a layer
quantizes whatever shard it holds (`Linear.quantize`), so an int4 column-parallel
linear is an int4 linear over its rank's rows.

A linear (or embedding) whose weight is packed (int4/int8, or a GGUF block format read in
place: engine.models.quant, engine.models.gguf_weight) holds only the packed weight; its
`weight` parameter is then an empty placeholder of the compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.forward_context import current_lora_mapping
from engine.distributed.parallel_state import get_tp_group
from engine.distributed.sharding import RowRange, even_range, padded_range
from engine.models.checkpoint_tensor import CheckpointTensor, read_rows
from engine.models.quant import QuantizedWeight, QuantSpec, can_quantize, quantize
from pagedserve_kernels.cpu_kernels import fused_ops_for


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def placeholder_param(dtype: torch.dtype) -> nn.Parameter:
    """What `weight` becomes once the layer's weight is packed: 0 elements, the dtype kept."""
    return nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> int:
    """dst.copy_(src) (casting dtype/device), after checking the shapes agree; dst.numel()."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
    return dst.numel()


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


class OffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = (1 + weight) * x / sqrt(mean(x^2) + eps). The checkpoint's
    `weight` is stored as 1 + weight at load, so the forward is RMSNorm's (fused ops
    included)."""

    def load_shard(self, param_name: str, tensor: CheckpointTensor, shard: None) -> int:
        return copy_checked(self.weight, read_rows(tensor).float() + 1.0, param_name)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias); weight [out_features, in_features] as in HF checkpoints.

    After `quantize(spec)` or `set_packed(w)` the layer holds its weight packed
    (`quantized`: int4/int8 or GGUF blocks), which serves every batch size: few rows on
    the integer kernels, many rows a decoded tile at a time; no dense copy is kept.
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
        # --enable-lora: an engine.lora.layers.LinearLoRA, set by engine/lora/manager.py
        # (engine.models does not import engine.lora: the manager imports the models).
        self.lora: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = (self.quantized.matmul(x, bias) if self.quantized is not None
               else F.linear(x, self.weight, bias))
        if self.lora is not None:  # --enable-lora: the adapters' side path
            mapping = current_lora_mapping()
            if mapping is not None:
                self.lora.add_to(out, x, mapping)
        return out

    def quantize(self, spec: QuantSpec, max_rows: int | None = None,
                 dtype: torch.dtype | None = None) -> bool:
        """Quantize the loaded weight and drop the dense one; False (and unchanged) if the
        shape does not suit. `dtype`: the model's (see quant.default_max_rows)."""
        if not can_quantize(self.out_features, self.in_features):
            return False
        self.set_packed(quantize(self.weight.data, spec, max_rows, dtype))
        return True

    def set_packed(self, packed) -> None:
        """Hold `packed` (QuantizedWeight, GGUFWeight, StackedWeight) as the weight."""
        if (packed.out_features, packed.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"packed weight [{packed.out_features}, {packed.in_features}] for a "
                             f"[{self.out_features}, {self.in_features}] linear")
        self.quantized = packed
        self.weight = placeholder_param(self.weight.dtype)


class MergedLinear(Linear):
    """Several linears over the same input, stacked along the output dim: one matmul.

    output_sizes [q, k, v] -> weight rows [0, q) | [q, q+k) | [q+k, q+k+v).
    The checkpoint's pieces arrive one at a time as shard 0, 1, 2, ...

    Column-parallel: with several ranks each piece is cut to this rank's
    `row_ranges[i]` of its checkpoint rows (default: an even share), so the local
    weight stacks the rank's rows of each piece. Example, gate_up [I=128, I=128]
    over 2 ranks: rank 1 holds gate rows [64, 128) then up rows [64, 128), and
    its `output_sizes` are [64, 64].
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 row_ranges: list[RowRange] | None = None):
        tp = get_tp_group()
        if row_ranges is None:
            row_ranges = [even_range(n, tp.rank, tp.size, "merged linear's output size")
                          for n in output_sizes]
        local_sizes = [r.size for r in row_ranges]
        super().__init__(in_features, sum(local_sizes), bias)
        self.row_ranges = list(row_ranges)
        self.output_sizes = local_sizes
        self.offsets = [sum(local_sizes[:i]) for i in range(len(local_sizes))]

    def load_shard(self, param_name: str, tensor: CheckpointTensor, shard: int | None) -> int:
        param = getattr(self, param_name)
        if shard is None:  # an already-merged checkpoint tensor: one rank only
            if get_tp_group().size > 1:
                raise ValueError(f"a merged checkpoint tensor ({param_name}) cannot be "
                                 "sharded; save q/k/v and gate/up separately")
            return copy_checked(param, read_rows(tensor), param_name)
        rows = param.narrow(0, self.offsets[shard], self.output_sizes[shard])
        return copy_checked(rows, read_rows(tensor, 0, self.row_ranges[shard]),
                            f"{param_name} shard {shard}")

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs of each merged linear, as views of one matmul's result."""
        return self(x).split(self.output_sizes, dim=-1)


class RowParallelLinear(Linear):
    """y = x @ W.T + b where each rank holds input columns `col_range` of W and gets the
    matching slice of x; the partial products are summed over the ranks (one
    all-reduce) and the bias added once, after the sum.

    Example, o_proj [H=64, 64] over 2 ranks: rank 1 holds W[:, 32:64] and multiplies
    the outputs of its own attention heads (columns 32-63 of the full attention output).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 col_range: RowRange | None = None):
        tp = get_tp_group()
        if col_range is None:
            col_range = even_range(in_features, tp.rank, tp.size, "row-parallel input size")
        super().__init__(col_range.size, out_features, bias)
        self.col_range = col_range

    def load_shard(self, param_name: str, tensor: CheckpointTensor, shard: None) -> int:
        if param_name == "bias":
            return copy_checked(self.bias, read_rows(tensor), "bias")
        return copy_checked(self.weight, read_rows(tensor, 1, self.col_range), param_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = get_tp_group()
        if tp.size == 1:
            return self._matmul(x, self.bias)
        out = tp.all_reduce(self._matmul(x, None))
        return out if self.bias is None else out + self.bias


def _load_vocab_rows(param: torch.Tensor, tensor: CheckpointTensor, rows: RowRange,
                     what: str) -> int:
    """Copy vocabulary `rows` into the first rows of `param`, zero its padding rows."""
    copy_checked(param.narrow(0, 0, rows.size), read_rows(tensor, 0, rows), what)
    param[rows.size:].zero_()
    return param.numel()


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; doubles as a tied lm_head.

    Vocab-parallel: each rank holds its `vocab_rows` (padded to equal shards, see
    `padded_range`); a token outside them looks up zeros and the all-reduce fills it in.
    Example, vocab 10 over 3 ranks: rank 1 holds tokens 4-7, so token 9 -> zeros on
    rank 1, its row on rank 2.
    """

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = get_tp_group()
        self.vocab_rows, shard = padded_range(vocab_size, tp.rank, tp.size)
        self.weight = empty_param(shard, hidden_size)
        self.packed = None  # a packed table (one rank): lookups decode only their rows

    def load_shard(self, param_name: str, tensor: CheckpointTensor, shard: None) -> int:
        return _load_vocab_rows(self.weight, tensor, self.vocab_rows, "embedding")

    def set_packed(self, packed) -> None:
        """Look rows up in `packed` (int8/int4 or GGUF blocks) and drop the dense table."""
        self.packed = packed
        self.weight = placeholder_param(self.weight.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = get_tp_group()
        if self.packed is not None:
            return self.packed.dequantize_rows(input_ids).to(self.weight.dtype)
        if tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_rows.start
        outside = (local_ids < 0) | (local_ids >= self.vocab_rows.size)
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tp.all_reduce(out)


class LMHead(Linear):
    """hidden [N, H] -> logits [N, vocab_size]: vocabulary rows split over the ranks.

    Each rank computes the logits of its (padded) vocabulary shard; they are
    all-gathered in rank order and the padding columns cut off. Tied: `weight` is the
    VocabEmbedding's parameter, whose shard is the same rows.
    """

    def __init__(self, hidden_size: int, vocab_size: int, weight: nn.Parameter | None = None):
        tp = get_tp_group()
        self.vocab_rows, shard = padded_range(vocab_size, tp.rank, tp.size)
        super().__init__(hidden_size, shard, bias=False, weight=weight)
        self.vocab_size = vocab_size

    def load_shard(self, param_name: str, tensor: CheckpointTensor, shard: None) -> int:
        return _load_vocab_rows(self.weight, tensor, self.vocab_rows, "lm_head")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self._matmul(x, None)
        tp = get_tp_group()
        if tp.size == 1:
            return logits
        return tp.all_gather(logits)[:, : self.vocab_size]


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


class GeluTanhAndMul(nn.Module):
    """x [..., 2I] = [gate | up] -> gelu_tanh(gate) * up (GeGLU: Gemma's MLP)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


_GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul,
                      "gelu_tanh": GeluTanhAndMul}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into `gate_up_proj`; act is
    silu (SwiGLU) or gelu with the tanh approximation (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 hidden_act: str = "silu"):
        super().__init__()
        if hidden_act not in _GATED_ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {hidden_act!r} "
                             f"(supported: {', '.join(_GATED_ACTIVATIONS)})")
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = _GATED_ACTIVATIONS[hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
