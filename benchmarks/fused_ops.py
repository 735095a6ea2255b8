"""The ops between a decoder layer's matmuls: hand-written C++ against torch.compile.

    python -m benchmarks.fused_ops [--batches 1 8 32 256] [--threads N]

One SmolLM2-135M layer's non-matmul work, per step: residual add + RMSNorm twice,
RoPE on q and k (views into the fused qkv output), SiLU x up. Three ways:

- eager: the torch references (`RMSNorm.forward_torch`, `apply_rotary`,
  `SiluAndMul.forward_torch`), op by op;
- compiled: the same functions through `torch.compile` (inductor's CPU backend,
  `dynamic=True` so one compile serves every batch size); its compile time is printed;
- cpp: pagedserve's fused ops (`pagedserve_kernels/cpu/fused_ops.cpp`, what the CPU path runs).

Prints microseconds per layer and per step (x 30 layers) with the CPU's flags. This
is the measurement behind issue 13's choice of hand-written ops over torch.compile.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from engine import cpu_info
from engine.models.layers import RMSNorm, SiluAndMul
from engine.models.rotary import apply_rotary
from pagedserve_kernels.cpu_kernels import cpu_kernels

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD, LAYERS = 576, 1536, 9, 3, 64, 30
EPS = 1e-5


def reference_layer(hidden, residual, qkv, gate_up, norm_weight, cos, sin):
    """The layer's non-matmul ops in plain torch (what inductor compiles)."""
    residual = hidden + residual
    normed = _rms(residual, norm_weight)
    q = qkv[:, : HEADS * HEAD].view(-1, HEADS, HEAD)
    k = qkv[:, HEADS * HEAD : (HEADS + KV_HEADS) * HEAD].view(-1, KV_HEADS, HEAD)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    residual2 = normed + residual
    normed2 = _rms(residual2, norm_weight)
    act = SiluAndMul.forward_torch(gate_up)
    return normed2, residual2, q, k, act


def _rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def cpp_layer(ops, norm: RMSNorm, hidden, residual, qkv, gate_up, cos, sin):
    ops.add_rms_norm_(hidden, residual, norm.weight, EPS)
    q = qkv[:, : HEADS * HEAD].view(-1, HEADS, HEAD)
    k = qkv[:, HEADS * HEAD : (HEADS + KV_HEADS) * HEAD].view(-1, KV_HEADS, HEAD)
    ops.rotary_neox_(q, k, cos, sin)
    ops.add_rms_norm_(hidden, residual, norm.weight, EPS)
    out = gate_up.new_empty(gate_up.shape[0], INTERMEDIATE)
    ops.silu_and_mul(out, gate_up)
    return out


def inputs(batch: int):
    torch.manual_seed(0)
    positions = torch.arange(batch) + 100
    inv_freq = 1.0 / (100000 ** (torch.arange(0, HEAD, 2).float() / HEAD))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (torch.randn(batch, HIDDEN), torch.randn(batch, HIDDEN),
            torch.randn(batch, (HEADS + 2 * KV_HEADS) * HEAD), torch.randn(batch, 2 * INTERMEDIATE),
            emb.cos(), emb.sin())


def time_us(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - start) / repeat)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 256])
    parser.add_argument("--threads", type=int, default=cpu_info.cpu_budget().num_threads)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("the C++ CPU kernels are not built here (no compiler?)")
    print(f"CPU: {cpu_info.describe()}; torch {torch.__version__}, {args.threads} threads")
    norm = RMSNorm(HIDDEN, eps=EPS)
    compiled = torch.compile(reference_layer, dynamic=True)
    start = time.perf_counter()
    with torch.inference_mode():
        compiled(*inputs(4)[:4], norm.weight, *inputs(4)[4:])
        compiled(*inputs(5)[:4], norm.weight, *inputs(5)[4:])
    print(f"torch.compile: first calls (compile, dynamic shapes) {time.perf_counter() - start:.1f} s")
    print("| batch | eager us/layer | torch.compile us/layer | C++ fused us/layer | "
          "C++ per step (x30) |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for batch in args.batches:
            args_ = inputs(batch)
            eager = time_us(partial(reference_layer, *args_[:4], norm.weight, *args_[4:]),
                            args.repeat)
            comp = time_us(partial(compiled, *args_[:4], norm.weight, *args_[4:]), args.repeat)
            cpp = time_us(partial(cpp_layer, ops, norm, *args_), args.repeat)
            print(f"| {batch} | {eager:.1f} | {comp:.1f} | {cpp:.1f} | "
                  f"{cpp * LAYERS / 1e3:.2f} ms (compile {comp * LAYERS / 1e3:.2f} ms) |")


if __name__ == "__main__":
    main()
