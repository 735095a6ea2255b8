"""Choose the attention backend for `--attention-backend auto|torch|flash_attn|triton`.

What `auto` picks, by device and `--block-size`:

    device  block size          flash-attn installed   ->  backend
    cpu     any                 any                        torch
    cuda    16 (the default)    any                        triton
    cuda    a multiple of 256   yes                        flash_attn
    cuda    a multiple of 256   no                         triton

Upstream flash-attn's paged KV (`flash_attn_varlen_func(..., block_table=...)`) needs
blocks of a multiple of 256 tokens; vLLM serves 16 with its own fork. The Triton
kernels (`pagedserve_kernels/`) serve any power-of-two block size from 16 up, so they are the
CUDA default. FlashInfer is not a choice: its wheel could not be installed and
measured against these on a GPU here (README, "GPU").
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from engine.attention.backends.base import AttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "flash_attn", "triton")
FLASH_ATTN_BLOCK_MULTIPLE = 256
# tl.dot needs every tile dimension >= 16, and tl.arange a power of two.
TRITON_MIN_BLOCK_SIZE = 16


@dataclass(frozen=True)
class BackendChoice:
    """What the selector decides from, so the decision is testable without CUDA."""

    name: str  # one of BACKEND_NAMES
    device_type: str  # "cpu" | "cuda"
    block_size: int
    flash_attn_installed: bool
    triton_interpreted: bool  # TRITON_INTERPRET=1: Triton kernels run on CPU tensors


def choose_backend_name(choice: BackendChoice) -> str:
    """The backend `choice` resolves to; raises ValueError when it cannot run."""
    name = choice.name
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
    on_cuda = choice.device_type == "cuda"
    if name == "auto":
        if not on_cuda:
            return "torch"
        return "flash_attn" if _flash_attn_fits(choice) else "triton"
    if name == "triton":
        if not on_cuda and not choice.triton_interpreted:
            raise ValueError("the triton backend needs a CUDA device (or TRITON_INTERPRET=1)")
        if on_cuda and not _triton_fits(choice.block_size):
            raise ValueError(
                f"the triton backend needs a power-of-two --block-size of at least "
                f"{TRITON_MIN_BLOCK_SIZE} on CUDA, got {choice.block_size}"
            )
    if name == "flash_attn":
        if not on_cuda:
            raise ValueError("the flash_attn backend needs a CUDA device")
        if not _flash_attn_fits(choice):
            raise ValueError(
                "flash_attn backend unavailable: install flash-attn and use a --block-size that "
                f"is a multiple of {FLASH_ATTN_BLOCK_MULTIPLE} (its paged-KV requirement), or "
                "use --attention-backend triton"
            )
    return name


def select_attention_backend(name: str, device: torch.device, block_size: int) -> AttentionBackend:
    """The backend object for `--attention-backend name` (see the module's table)."""
    resolved = choose_backend_name(BackendChoice(
        name=name, device_type=device.type, block_size=block_size,
        flash_attn_installed=importlib.util.find_spec("flash_attn") is not None,
        triton_interpreted=os.environ.get("TRITON_INTERPRET") == "1",
    ))
    if resolved == "torch":
        from engine.attention.backends.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if resolved == "triton":
        from engine.attention.backends.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from engine.attention.backends.flash_attn_backend import FlashAttentionBackend

    return FlashAttentionBackend()


def _flash_attn_fits(choice: BackendChoice) -> bool:
    return choice.flash_attn_installed and choice.block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0


def _triton_fits(block_size: int) -> bool:
    return block_size >= TRITON_MIN_BLOCK_SIZE and block_size & (block_size - 1) == 0
