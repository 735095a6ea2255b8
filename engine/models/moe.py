"""Mixture of experts: a softmax top-k router over stacked expert MLPs.

Tokens are grouped by expert and each expert that received any runs one
batched gated MLP over its tokens: a loop over experts, never over tokens.

With several ranks the experts are split one of two ways; either way the block's
output is summed over the ranks (one all-reduce) and the router is replicated:
- tensor parallel (default): every rank holds every expert, each with its share of
  the intermediate columns (like a GatedMLP's gate_up / down);
- expert parallel (`--enable-expert-parallel`): each rank holds whole experts, an
  equal share of them, and runs only the token slots routed to those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_group
from engine.distributed.sharding import RowRange, even_range
from engine.models.checkpoint_tensor import CheckpointTensor, read_rows, shape_of
from engine.models.layers import Linear, copy_checked, empty_param


class FusedExperts(nn.Module):
    """E gated MLPs stacked: gate_up_proj [E, 2I, H] (gate rows, then up), down_proj [E, H, I].

    Checkpoints store either these stacked tensors (loaded whole) or one
    tensor per expert and projection, loaded as shard (expert, part) with part
    0 = gate, 1 = up (gate_up_proj) and 0 (down_proj).

    With several ranks this rank holds experts `experts` and, of each, the
    intermediate columns `cols`. Tensor parallel, I = 32 over 2 ranks, rank 1:
    experts = all E, cols [16, 32): gate_up_proj[e] holds checkpoint gate rows 16-31
    then up rows 16-31; down_proj[e] columns 16-31. Expert parallel, E = 8 over 2
    ranks, rank 1: experts [4, 8), cols = all I: gate_up_proj[0] is expert 4, whole.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        tp = get_tp_group()
        if tp.expert_parallel:
            self.experts = even_range(num_experts, tp.rank, tp.size, "number of MoE experts")
            self.cols = RowRange(0, intermediate_size)
        else:
            self.experts = RowRange(0, num_experts)
            self.cols = even_range(intermediate_size, tp.rank, tp.size, "MoE intermediate size")
        self.num_experts = num_experts
        self.intermediate_size = self.cols.size
        self.gate_up_proj = empty_param(self.experts.size, 2 * self.cols.size, hidden_size)
        self.down_proj = empty_param(self.experts.size, hidden_size, self.cols.size)

    def load_shard(self, param_name: str, tensor: CheckpointTensor,
                   shard: tuple[int, int] | None) -> int:
        size, cols, experts = self.intermediate_size, self.cols, self.experts
        if shard is None:  # stacked [E, 2I, H] (gate rows, then up rows) / [E, H, I]
            if param_name == "down_proj":
                return copy_checked(self.down_proj, _read_experts(tensor, experts, 2, cols),
                                    param_name)
            total = shape_of(tensor)[1] // 2
            for part in (0, 1):
                rows = RowRange(part * total + cols.start, cols.size)
                copy_checked(self.gate_up_proj[:, part * size : (part + 1) * size],
                             _read_experts(tensor, experts, 1, rows), param_name)
            return self.gate_up_proj.numel()
        expert, part = shard
        if not experts.start <= expert < experts.stop:
            return 0  # another rank's expert (expert parallel)
        local = expert - experts.start
        if param_name == "gate_up_proj":
            dst = self.gate_up_proj[local, part * size : (part + 1) * size]
            return copy_checked(dst, read_rows(tensor, 0, cols), f"expert {expert} {param_name}")
        return copy_checked(self.down_proj[local], read_rows(tensor, 1, cols),
                            f"expert {expert} {param_name}")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """x [T, H], topk_ids/topk_weights [T, k] -> sum_j w[t, j] * expert_{ids[t, j]}(x[t]),
        the sum taken over this rank's experts only (the all-reduce adds the rest).

        Worked example, T=3 tokens, k=2, E=4 experts, this rank holds all 4:
            topk_ids        = [[2, 0], [0, 3], [2, 1]]
            flat ids        = [2, 0, 0, 3, 2, 1]        slot s belongs to token s // k
            order (by id)   = [1, 2, 5, 0, 4, 3]        ids in that order: [0, 0, 1, 2, 2, 3]
            counts          = [2, 1, 2, 1]              expert 0 <- slots 1, 2 = tokens 0, 1
        Holding experts [2, 4) only (expert parallel, rank 1 of 2): local ids = ids - 2,
        and the other ranks' ids become 2 (= one past the last local expert), so
            local ids       = [0, 2, 2, 1, 0, 2]        counts [2, 1] (+3 slots skipped)
        """
        top_k = topk_ids.shape[1]
        experts = self.experts
        flat_ids = topk_ids.reshape(-1)
        if experts.size != self.num_experts:
            flat_ids = flat_ids - experts.start
            flat_ids = torch.where((flat_ids >= 0) & (flat_ids < experts.size), flat_ids,
                                   experts.size)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=experts.size + 1)[: experts.size].tolist()
        flat_weights = topk_weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            start += count
            tokens = slots // top_k
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, expert_out * flat_weights[slots, None])
        return out


def _read_experts(tensor: CheckpointTensor, experts: RowRange, dim: int,
                  rows: RowRange) -> torch.Tensor:
    """stacked[experts, ..., rows along `dim`, ...], read from disk in one slice.

    Example: down_proj [8, H, I], experts [4, 8), dim 2, rows [0, I) -> [4, H, I].
    """
    index = ((slice(experts.start, experts.stop),) + (slice(None),) * (dim - 1)
             + (slice(rows.start, rows.stop),))
    return tensor[index]


class SparseMoeBlock(nn.Module):
    """Router `gate` (a linear to E logits) -> softmax -> top-k -> experts.

    With `norm_topk_prob` the k chosen probabilities are renormalised to sum to 1.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 norm_topk_prob: bool):
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return get_tp_group().all_reduce(self.experts(x, topk_ids, topk_weights.to(x.dtype)))
