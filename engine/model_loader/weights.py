"""Build a model from an HF checkpoint directory: dtype choice, safetensors streaming."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine import cpu_info
from engine.distributed.parallel_state import get_tp_group
from engine.model_loader.gguf import gguf_source, mmproj_source
from engine.model_loader.hf_config import load_hf_config
from engine.model_loader.quantize import QuantizationReport, quantize_model
from engine.models import get_model_class
from engine.models.weight_arena import move_into_arena

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
            "half": "float16"}


def resolve_dtype(config, dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """The compute dtype for `--dtype auto|float32|bfloat16|float16`.

    auto on CPU follows the hardware, whatever the checkpoint says: bfloat16 where
    the CPU has native bf16 (avx512_bf16 or AMX), float32 elsewhere (there bf16
    matmuls are emulated and several times slower than float32).
    auto on CUDA = the checkpoint's `dtype` (`torch_dtype` in older configs;
    float32 if neither is set). An explicit choice is honoured as given.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _ALIASES.get(dtype, dtype)
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if torch.device(device).type == "cpu":
        return auto_cpu_dtype()[0]
    # transformers v5 calls it `dtype` (and warns on reading `torch_dtype`); v4 `torch_dtype`
    declared = config.dtype if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = DTYPES.get(declared.removeprefix("torch."), torch.float32)
    if declared not in DTYPES.values():
        declared = torch.float32
    return declared


def auto_cpu_dtype() -> tuple[torch.dtype, str]:
    """(dtype, why) for --dtype auto on this CPU."""
    reason = cpu_info.native_bf16_reason()
    if reason:
        return torch.bfloat16, f"the CPU has native bf16 ({reason})"
    return torch.float32, "the CPU has no native bf16 (no avx512_bf16/amx_bf16): float32 is faster"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of the index if sharded, else `*.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (other formats "
                                "are not supported; convert with transformers' save_pretrained)")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, read one at a time on CPU."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iter_safetensors_slices(model_dir: str | Path) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for every tensor: a layer reads only the rows it holds
    (`engine.models.checkpoint_tensor.read_rows`), so a tensor-parallel rank reads
    its shard of each tensor from disk and nothing more."""
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_dir: str | Path, dtype: torch.dtype | str = "auto",
               device: torch.device | str = "cpu", quantization: str = "none",
               hf_overrides: dict | None = None) -> nn.Module:
    """Our implementation of the checkpoint in `model_dir`, weights loaded, in eval mode.

    Parameters are allocated directly in `dtype` on `device` and never require
    grad; tensors stream from disk one at a time. A GGUF source (`model_dir` is its
    cache directory: engine.model_loader.gguf) with `quantization` auto keeps its
    quantized tensors packed, read in place; otherwise `quantization` (see
    engine.model_loader.quantize) may give linears int8/int4 weights. What was done is
    `model.quantization_report` (and `model.gguf_report` for a GGUF file). `hf_overrides`:
    --hf-overrides' config.json values (engine.model_loader.hf_config).
    """
    config = load_hf_config(model_dir, hf_overrides)
    dtype = resolve_dtype(config, dtype, device)
    model_class = get_model_class(config)
    start = time.perf_counter()
    with torch.device(device), _default_dtype(dtype):
        model = model_class(config)
    gguf_file = gguf_source(model_dir)
    if gguf_file is not None:
        from engine.model_loader.gguf_weights import load_gguf_weights

        pack, why = _packs_gguf(quantization, device)
        if not pack:
            logger.info("%s: dequantizing every tensor to dense %s in memory (%s)",
                        gguf_file.name, dtype, why)
        with torch.device(device):
            model.gguf_report = load_gguf_weights(model, gguf_file, pack, dtype,
                                                  mmproj=mmproj_source(model_dir))
    else:
        model.load_weights(iter_safetensors_slices(model_dir))
    model.eval().requires_grad_(False)
    report: QuantizationReport = quantize_model(model, quantization, device, dtype=dtype)
    model.quantization_report = report
    if torch.device(device).type == "cpu":
        move_into_arena(model)  # 2 MiB pages in the order the forward reads them
    _return_freed_memory()
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    logger.info("loaded %s (%s, %s) from %s in %.1f s: %s",
                model_class.__name__, dtype, torch.device(device), gguf_file or model_dir,
                time.perf_counter() - start,
                load_summary(getattr(model, "gguf_report", None), report, dense_bytes, device))
    return model


def load_summary(gguf_report, report: QuantizationReport, dense_bytes: int,
                 device: torch.device | str) -> str:
    """What was loaded and how, in one line that never contradicts itself.

    Example: "GGUF in place: 210 Q4_1 -> int4, 1 Q8_0 -> int8 (92.0 MiB packed), 0.1 MiB
    dense; linears on the packed kernels (avx512)"
    """
    packed_bytes = report.quantized_bytes
    parts = []
    if gguf_report is not None:
        parts.append("GGUF in place: " + gguf_report.formats())
        packed_bytes += gguf_report.packed_bytes
    elif report.specs:
        parts.append(report.summary())
    where = torch.device(device).type
    if packed_bytes:
        kernels = f"the packed kernels ({cpu_info.vector_isa()})" if where == "cpu" else "packed kernels"
        parts.append(f"{packed_bytes / 2**20:.1f} MiB packed, {dense_bytes / 2**20:.1f} MiB "
                     f"dense; linears on {kernels}")
    else:
        parts.append(f"{dense_bytes / 2**20:.1f} MiB of dense weights; all linears dense")
    return "; ".join(parts)


def _return_freed_memory() -> None:
    """Hand the heap that loading freed (repacking's temporaries) back to the OS: glibc
    keeps freed arenas otherwise, and the process's RSS would count them for its life."""
    libc = cpu_info.libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)


def _packs_gguf(quantization: str, device: torch.device | str) -> tuple[bool, str]:
    """Whether a GGUF file's quantized tensors stay packed, and if not, why."""
    from pagedserve_kernels.cpu_kernels import cpu_kernels

    if quantization != "auto":
        return False, f"--quantization {quantization}"
    if torch.device(device).type != "cpu":
        return False, "the packed GGUF kernels run on the CPU only"
    if get_tp_group().size > 1:
        return False, "packed GGUF weights are not sharded for tensor parallelism"
    if cpu_kernels() is None:
        return False, "the C++ CPU kernels are unavailable"
    return True, ""
