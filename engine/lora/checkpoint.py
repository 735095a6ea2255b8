"""LoRA adapters on disk: PEFT's `adapter_config.json` + `adapter_model.safetensors`
(below), or llama.cpp's LoRA GGUF (engine/lora/gguf_adapter.py).

    {"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"], "use_rslora": false}
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]

The layer computes y = W x + scale * B (A x), scale = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). `check_adapter` reads the config and the tensors' shapes (not
their data) and refuses what the base cannot run, with a message for the client;
`read_adapter` returns the weights by module path of the base (`model.layers.0.self_attn.q_proj`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.lora.gguf_adapter import (
    gguf_adapter_shapes,
    is_gguf_adapter,
    open_gguf_adapter,
    read_gguf_adapter,
)
from engine.model_loader.safetensors_header import read_header

if TYPE_CHECKING:  # the HTTP frontend checks adapters without loading torch
    import torch

# The linears an adapter may target, by the name of the checkpoint's module: what the
# decoder layers of every family served here compute (Phi-3's merged ones too).
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
                     "gate_proj", "up_proj", "down_proj", "gate_up_proj")
_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter this server cannot run: the message says why (a 400 for the client)."""


@dataclass(frozen=True)
class AdapterInfo:
    path: str
    rank: int
    scale: float


def base_linear_shape(config: Any, target: str) -> tuple[int, int]:
    """(out, in) of a base linear from its HF config."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inter = config.intermediate_size
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
            "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "qkv_proj": ((heads + 2 * kv_heads) * head_dim, hidden),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter), "gate_up_proj": (2 * inter, hidden)}[target]


def _files(path: str) -> tuple[Path, Path]:
    root = Path(path)
    config, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config.is_file():
        raise AdapterError(f"LoRA adapter {path!r}: no adapter_config.json there")
    if not weights.is_file():
        raise AdapterError(f"LoRA adapter {path!r}: no adapter_model.safetensors there "
                           "(PEFT's save_pretrained writes it; .bin adapters are not read)")
    return config, weights


def module_of(key: str) -> tuple[str, str] | None:
    """A checkpoint key -> (base module path, "lora_A" | "lora_B"), None if not LoRA's.
    Example: 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'
    -> ('model.layers.0.self_attn.q_proj', 'lora_A')."""
    name = key.removeprefix(_PREFIX)
    for part in ("lora_A", "lora_B"):
        marker = f".{part}."
        if marker in name:
            return name.split(marker)[0], part
    return None


def check_adapter(path: str, hf_config: Any, max_rank: int) -> AdapterInfo:
    """The adapter at `path` (a PEFT directory, or a llama.cpp LoRA GGUF file:
    engine/lora/gguf_adapter.py) if the base described by `hf_config` can run it; raises
    AdapterError naming the problem (missing file, rank over `max_rank`, a module the
    server does not adapt, a shape that does not fit the base)."""
    if is_gguf_adapter(path):
        return _check_gguf_adapter(path, hf_config, max_rank)
    config_file, weights_file = _files(path)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"LoRA adapter {path!r}: adapter_config.json: {exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"LoRA adapter {path!r}: peft_type {config['peft_type']!r} "
                           "is not LORA")
    rank = int(config.get("r", 0))
    _check_rank(path, rank, max_rank)
    for unsupported in ("modules_to_save", "layers_to_transform", "rank_pattern",
                        "alpha_pattern"):
        if config.get(unsupported):
            raise AdapterError(f"LoRA adapter {path!r}: {unsupported} is not supported")
    if config.get("use_dora"):
        raise AdapterError(f"LoRA adapter {path!r}: DoRA is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"LoRA adapter {path!r}: trained biases (bias="
                           f"{config['bias']!r}) are not supported")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = []
    for key, shape in _tensor_shapes(weights_file).items():
        found = module_of(key)
        if found is None:
            raise AdapterError(f"LoRA adapter {path!r}: tensor {key!r} is not a LoRA "
                               "A/B matrix")
        tensors.append((key, *found, shape))
    _check_shapes(path, hf_config, rank, tensors)
    return AdapterInfo(path, rank, scale)


def _check_gguf_adapter(path: str, hf_config: Any, max_rank: int) -> AdapterInfo:
    try:
        gguf, alpha = open_gguf_adapter(path, hf_config)
        shapes = gguf_adapter_shapes(gguf)
    except ValueError as exc:
        raise AdapterError(f"LoRA adapter {path!r}: {exc}") from None
    ranks = {shape[0] for _, part, shape in shapes.values() if part == "lora_A"}
    if len(ranks) > 1:
        raise AdapterError(f"LoRA adapter {path!r}: ranks {sorted(ranks)} differ between "
                           "modules (one rank per adapter is supported)")
    rank = ranks.pop() if ranks else 0
    _check_rank(path, rank, max_rank)
    _check_shapes(path, hf_config, rank,
                  [(key, module, part, shape) for key, (module, part, shape) in shapes.items()])
    return AdapterInfo(path, rank, alpha / rank if alpha else 1.0)  # llama.cpp's scale


def _check_rank(path: str, rank: int, max_rank: int) -> None:
    if not 0 < rank <= max_rank:
        raise AdapterError(f"LoRA adapter {path!r}: rank {rank} is over --max-lora-rank "
                           f"{max_rank}" if rank > max_rank else
                           f"LoRA adapter {path!r}: rank {rank} must be positive")


def _check_shapes(path: str, hf_config: Any, rank: int,
                  tensors: list[tuple[str, str, str, tuple[int, ...]]]) -> None:
    """Each (key, base module path, "lora_A" | "lora_B", shape) fits the base."""
    for key, module, part, shape in tensors:
        target = module.rsplit(".", 1)[-1]
        if target not in SUPPORTED_TARGETS:
            raise AdapterError(f"LoRA adapter {path!r}: module {target!r} is not one "
                               f"this server adapts ({', '.join(SUPPORTED_TARGETS)})")
        layer = _layer_index(module)
        if layer is None or layer >= hf_config.num_hidden_layers:
            raise AdapterError(f"LoRA adapter {path!r}: {module!r} is not a layer of "
                               "the base model")
        out, inp = base_linear_shape(hf_config, target)
        want = (rank, inp) if part == "lora_A" else (out, rank)
        if tuple(shape) != want:
            raise AdapterError(f"LoRA adapter {path!r}: {key} is {list(shape)}, the base "
                               f"needs {list(want)} (an adapter of another model?)")
    if not tensors:
        raise AdapterError(f"LoRA adapter {path!r}: no LoRA weights")


def _tensor_shapes(weights_file: Path) -> dict[str, tuple[int, ...]]:
    """A safetensors file's tensor names and shapes, from its header alone (8 bytes of
    little-endian length, then that much JSON)."""
    try:
        header = read_header(weights_file)
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {weights_file.parent}: "
                           f"adapter_model.safetensors is unreadable: {exc}") from None
    return {key: tuple(value["shape"]) for key, value in header.items()}


def _layer_index(module: str) -> int | None:
    parts = module.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def read_adapter(info: AdapterInfo, hf_config: Any, dtype: torch.dtype, device: torch.device
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Base module path -> (A [r, in], scale * B [out, r]) in `dtype` on `device`."""
    if is_gguf_adapter(info.path):
        pairs = read_gguf_adapter(open_gguf_adapter(info.path, hf_config)[0], hf_config)
    else:
        from safetensors.torch import load_file

        pairs = {}
        for key, tensor in load_file(str(_files(info.path)[1])).items():
            module, part = module_of(key)
            pairs.setdefault(module, {})[part] = tensor
    out = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"LoRA adapter {info.path!r}: {module} lacks its "
                               f"{'lora_B' if 'lora_A' in pair else 'lora_A'} matrix")
        out[module] = (pair["lora_A"].to(device, dtype),
                       (pair["lora_B"].float() * info.scale).to(device, dtype))
    return out
