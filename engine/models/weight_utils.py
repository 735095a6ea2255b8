"""Map HF checkpoint tensor names onto our (fused) parameters and copy them in.

    model.layers.0.self_attn.k_proj.weight      -> ...self_attn.qkv_proj.weight   shard 1
    model.layers.0.mlp.up_proj.bias             -> ...mlp.gate_up_proj.bias        shard 1
    model.layers.0.mlp.experts.5.up_proj.weight -> ...mlp.experts.gate_up_proj     shard (5, 1)
    model.layers.0.mlp.experts.5.down_proj.weight -> ...mlp.experts.down_proj      shard (5, 0)
    anything else                               -> the parameter of the same name
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import nn

from engine.models.checkpoint_tensor import CheckpointTensor, read_rows
from engine.models.layers import copy_checked

# (checkpoint part, our fused part, shard index)
_STACKED = (
    (".q_proj.", ".qkv_proj.", 0),
    (".k_proj.", ".qkv_proj.", 1),
    (".v_proj.", ".qkv_proj.", 2),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_TARGET = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                  "down_proj": ("down_proj", 0)}
_IGNORED = ("rotary_emb.inv_freq",)


def map_weight_name(name: str) -> tuple[str, int | tuple[int, int] | None]:
    """(our parameter name, shard) for a checkpoint tensor; shard None = the whole parameter."""
    match = _EXPERT.match(name)
    if match:
        fused, part = _EXPERT_TARGET[match["proj"]]
        return f"{match['prefix']}.{fused}", (int(match["expert"]), part)
    for part, fused, shard in _STACKED:
        if part in name:
            return name.replace(part, fused), shard
    return name, None


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]], skip_lm_head: bool = False
) -> None:
    """Copy each (name, tensor) into `model`, then check every parameter got filled.

    Modules holding fused or tensor-parallel parameters implement
    `load_shard(param_name, tensor, shard) -> elements filled`; they read only their
    rank's part of a lazily read (safetensors slice) tensor. Others get the whole tensor.
    """
    params = dict(model.named_parameters())
    filled: dict[str, int] = defaultdict(int)
    with torch.no_grad():
        for name, tensor in weights:
            if any(part in name for part in _IGNORED):
                continue
            if skip_lm_head and name.startswith("lm_head."):
                continue  # tied to embed_tokens
            target, shard = map_weight_name(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in "
                                 f"{type(model).__name__} (looked for {target!r})")
            module_name, _, leaf = target.rpartition(".")
            loader = getattr(model.get_submodule(module_name), "load_shard", None)
            if loader is not None:
                filled[target] += loader(leaf, tensor, shard)
            elif shard is None:
                filled[target] += copy_checked(params[target], read_rows(tensor), name)
            else:
                raise ValueError(f"checkpoint tensor {name!r}: {module_name} takes no shards")
    missing = [n for n, p in params.items() if filled[n] < p.numel()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"the checkpoint did not fill {len(missing)} parameter(s): {shown}")
