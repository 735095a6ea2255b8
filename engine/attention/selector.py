"""Choose the attention backend for `--attention-backend auto|torch|flash_attn|triton`."""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from engine.attention.backends.base import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "flash_attn", "triton")


def select_attention_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """auto: CPU -> torch; CUDA -> flash_attn if it imports and fits, else triton."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    if name == "auto":
        if device.type != "cuda":
            name = "torch"
        elif _flash_attn_usable(block_size):
            name = "flash_attn"
        else:
            name = "triton"
    if name == "torch":
        from engine.attention.backends.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1)")
        from engine.attention.backends.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if device.type != "cuda":
        raise ValueError("the flash_attn backend needs a CUDA device")
    if not _flash_attn_usable(block_size):
        raise ValueError(
            "flash_attn backend unavailable: install flash-attn and use a --block-size that is "
            "a multiple of 256 (its paged-KV requirement), or use --attention-backend triton"
        )
    from engine.attention.backends.flash_attn_backend import FlashAttentionBackend

    return FlashAttentionBackend()


def _flash_attn_usable(block_size: int) -> bool:
    return importlib.util.find_spec("flash_attn") is not None and block_size % 256 == 0
