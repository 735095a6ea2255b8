"""The attention backend `auto` picks per device and block size (no CUDA needed)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.selector import BackendChoice, choose_backend_name, select_attention_backend


def choice(name="auto", device_type="cuda", block_size=16, flash_attn_installed=True,
           triton_interpreted=False) -> BackendChoice:
    return BackendChoice(name, device_type, block_size, flash_attn_installed, triton_interpreted)


@pytest.mark.parametrize(("device_type", "block_size", "flash", "expected"), [
    ("cpu", 16, True, "torch"),
    ("cpu", 256, True, "torch"),
    ("cuda", 16, True, "triton"),  # the CUDA default serves 16 even with flash-attn there
    ("cuda", 16, False, "triton"),
    ("cuda", 32, True, "triton"),
    ("cuda", 256, True, "flash_attn"),
    ("cuda", 512, True, "flash_attn"),
    ("cuda", 256, False, "triton"),
])
def test_auto(device_type, block_size, flash, expected):
    assert choose_backend_name(choice("auto", device_type, block_size, flash)) == expected


def test_explicit_choices_kept_where_they_run():
    assert choose_backend_name(choice("torch", "cuda")) == "torch"
    assert choose_backend_name(choice("triton", "cuda", 64)) == "triton"
    assert choose_backend_name(choice("flash_attn", "cuda", 256)) == "flash_attn"
    assert choose_backend_name(choice("triton", "cpu", 4, triton_interpreted=True)) == "triton"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(name="flash_attn", block_size=16), "multiple of 256"),
    (dict(name="flash_attn", block_size=256, flash_attn_installed=False), "install flash-attn"),
    (dict(name="flash_attn", device_type="cpu", block_size=256), "needs a CUDA device"),
    (dict(name="triton", device_type="cpu"), "TRITON_INTERPRET"),
    (dict(name="triton", block_size=8), "power-of-two --block-size of at least 16"),
    (dict(name="triton", block_size=48), "power-of-two"),
    (dict(name="xformers"), "unknown attention backend"),
])
def test_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        choose_backend_name(choice(**kwargs))


def test_select_on_cpu_builds_the_torch_backend():
    backend = select_attention_backend("auto", torch.device("cpu"), 16)
    assert backend.name == "torch"
