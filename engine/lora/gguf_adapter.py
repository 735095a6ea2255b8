"""llama.cpp LoRA adapters: the one GGUF file llama.cpp's `convert_lora_to_gguf.py` writes
from a PEFT adapter (what llama-server's `--lora FILE` reads).

    general.type = "adapter", adapter.type = "lora", adapter.lora.alpha = 16.0
    blk.0.attn_q.weight.lora_a   [r, in]     (numpy order: GGML's ne reversed)
    blk.0.attn_q.weight.lora_b   [out, r]

The scale is alpha / r, as llama.cpp applies it (alpha 0 means 1; llama.cpp has no
rsLoRA). The converter permutes a Llama's q/k output rows as it does the base's
(engine/model_loader/gguf.py unpermute_rotary_rows): lora_b's rows are un-permuted
here, so the adapter fits the base as loaded. Reads the header with numpy only (the
HTTP frontend checks adapters without torch).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model_loader.gguf import hf_tensor_name, unpermute_rotary_rows
from engine.model_loader.gguf_file import GGUFFile, UnsupportedGGUFError

if TYPE_CHECKING:
    import torch

_PARTS = {".lora_a": "lora_A", ".lora_b": "lora_B"}


def is_gguf_adapter(path: str) -> bool:
    """Whether `path` names a GGUF file (else: a PEFT directory)."""
    return Path(path).is_file() and str(path).endswith(".gguf")


def open_gguf_adapter(path: str, hf_config: Any) -> tuple[GGUFFile, float]:
    """The adapter file and its alpha; ValueError if it is no LoRA adapter of a base of
    `hf_config`'s architecture."""
    try:
        gguf = GGUFFile(path)
    except (OSError, UnsupportedGGUFError) as exc:
        raise ValueError(f"unreadable GGUF: {exc}") from None
    kind = (gguf.get("general.type"), gguf.get("adapter.type"))
    if kind != ("adapter", "lora"):
        raise ValueError(f"a GGUF of general.type {kind[0]!r} / adapter.type {kind[1]!r}, "
                         "not a LoRA adapter (llama.cpp's convert_lora_to_gguf.py writes one)")
    architecture = gguf.get("general.architecture")
    base = getattr(hf_config, "model_type", None)
    if architecture is not None and base is not None and not base.startswith(architecture):
        raise ValueError(f"an adapter of a {architecture!r} model; the base is {base!r}")
    return gguf, float(gguf.get("adapter.lora.alpha", 0.0))


def gguf_adapter_shapes(gguf: GGUFFile) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """GGUF tensor name -> (base module path, "lora_A" | "lora_B", shape). Example:
    'blk.0.attn_q.weight.lora_a' -> ('model.layers.0.self_attn.q_proj', 'lora_A', (8, 256))."""
    out = {}
    architecture = gguf.get("general.architecture")
    for name, info in gguf.tensors.items():
        suffix = name[-len(".lora_a"):]
        if suffix not in _PARTS:
            raise ValueError(f"tensor {name!r} is not a LoRA A/B matrix")
        try:
            hf_name = hf_tensor_name(name[: -len(suffix)], architecture)
        except UnsupportedGGUFError:
            raise ValueError(f"tensor {name!r} adapts no linear of the base") from None
        out[name] = (hf_name.removesuffix(".weight"), _PARTS[suffix], info.shape)
    return out


def read_gguf_adapter(gguf: GGUFFile, hf_config: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Base module path -> {"lora_A": [r, in], "lora_B": [out, r]} in float32, q/k rows
    in the base's (HF's) order."""
    import torch

    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    permuted = {"attn_q": heads, "attn_k": kv_heads} \
        if gguf.get("general.architecture") == "llama" else {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, (module, part, _) in gguf_adapter_shapes(gguf).items():
        values = gguf.load(name)
        kind = name.split(".")[2]  # blk.N.<kind>.weight.lora_b
        if part == "lora_B" and kind in permuted:
            values = unpermute_rotary_rows(values, permuted[kind])
        pairs.setdefault(module, {})[part] = torch.from_numpy(values)
    return pairs
