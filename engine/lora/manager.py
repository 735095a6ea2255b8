"""The worker's LoRA adapters: side paths on the base's linears, weights loaded on first
use, the least recently used dropped past `max_cpu_loras`.

The base model's decoder linears each get a `LinearLoRA` (engine/lora/layers.py) when
the runner is built with --enable-lora; an adapter's matrices are read from its
directory the first time a request of it is scheduled (the frontend checked it already:
engine/lora/checkpoint.py) and kept while requests use it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from engine.attention.forward_context import LoRAMapping
from engine.lora.checkpoint import check_adapter, read_adapter
from engine.lora.layers import LinearLoRA
from engine.lora_request import LoRARequest
from engine.models.layers import Linear, MergedLinear

# A checkpoint module name -> (this engine's module name beside it, piece): q/k/v live
# in one qkv_proj and gate/up in one gate_up_proj (engine/models/llama.py).
MERGED_PIECES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1),
                 "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0),
                 "up_proj": ("gate_up_proj", 1)}
ADAPTED_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAModelManager:
    def __init__(self, model: nn.Module, hf_config, max_cpu_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.hf_config = hf_config
        self.max_cpu_loras = max_cpu_loras
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device  # the adapters' weights: the model's dtype
        self.linears: dict[str, Linear] = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in ADAPTED_MODULES:
                pieces = (list(zip(module.offsets, module.output_sizes, strict=True))
                          if isinstance(module, MergedLinear) else [(0, module.out_features)])
                module.lora = LinearLoRA(pieces)
                self.linears[name] = module
        if not self.linears:
            raise ValueError(f"--enable-lora: {type(model).__name__} has no linears LoRA "
                             "adapters target here")
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()  # oldest use first

    def _target(self, module_path: str) -> tuple[str, int]:
        """A checkpoint module path -> (this model's linear, piece index). Example:
        'model.layers.0.self_attn.k_proj' -> ('model.layers.0.self_attn.qkv_proj', 1)."""
        if module_path in self.linears:
            return module_path, 0
        parent, _, leaf = module_path.rpartition(".")
        merged, piece = MERGED_PIECES[leaf]
        return f"{parent}.{merged}", piece

    def activate(self, requests: list[LoRARequest], in_use: set[int]) -> None:
        """Load the adapters of `requests` not loaded yet; mark them used; drop the least
        recently used ones not `in_use` while more than max_cpu_loras are loaded."""
        in_use = in_use | {request.lora_id for request in requests}
        for request in requests:
            if request.lora_id in self.loaded:
                self.loaded.move_to_end(request.lora_id)
                continue
            self._load(request)
        while len(self.loaded) > self.max_cpu_loras:
            victim = next((i for i in self.loaded if i not in in_use), None)
            if victim is None:
                break
            self.unload(victim)

    def _load(self, request: LoRARequest) -> None:
        info = check_adapter(request.path, self.hf_config, self.max_rank)
        by_linear: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        weights = read_adapter(info, self.hf_config, self.dtype, self.device)
        for module_path, pair in weights.items():
            name, piece = self._target(module_path)
            by_linear.setdefault(name, {})[piece] = pair
        for name, weights in by_linear.items():
            self.linears[name].lora.set_adapter(request.lora_id, weights)
        self.loaded[request.lora_id] = request

    def unload(self, lora_id: int) -> None:
        for linear in self.linears.values():
            linear.lora.drop_adapter(lora_id)
        self.loaded.pop(lora_id, None)

    def mapping(self, token_lora_ids: np.ndarray) -> LoRAMapping | None:
        """The step's mapping from each token's adapter id (0: the base).
        Example: [0, 3, 3, 5] -> groups [(3, [1, 2]), (5, [3])]."""
        ids = np.unique(token_lora_ids)
        ids = ids[ids != 0]
        if len(ids) == 0:
            return None
        if len(ids) == 1 and (token_lora_ids == ids[0]).all():
            return LoRAMapping([(int(ids[0]), None)])
        return LoRAMapping([
            (int(i), torch.from_numpy(np.flatnonzero(token_lora_ids == i)).to(self.device))
            for i in ids])
