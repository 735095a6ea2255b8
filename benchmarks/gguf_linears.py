"""Packed linears at each batch width: the few-row kernel against the tiled path.

    python -m benchmarks.gguf_linears                 # a 1B Llama layer's shapes, Q4_K/Q6_K/int4/int8
    python -m benchmarks.gguf_linears --rows 1 8 32 --dtype float32

For one decoder layer of a Llama with hidden 2048, intermediate 8192 and 8 KV heads of 64
(qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048, down 2048 x 8192), random weights in
each format, prints the best-of-N milliseconds of the four linears at each row count on
the few-row kernel (integer, batch invariant) and on the tiled path (decoded tiles and
one matmul in `--dtype`). The crossover is where `default_max_rows` (engine.models.quant)
should sit for this CPU; the weights of 8 layers are cycled so they come from memory, not
from the cache, as in a real forward pass. Prints the CPU's SIMD flags first.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from benchmarks.compare_servers import cpu_flags
from engine.models.quant import QuantSpec, quantize
from kernels.cpu_kernels import cpu_kernels

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
LAYERS = 8


def random_rows(ggml_type: GGMLQuantizationType, rows: int, cols: int, rng) -> torch.Tensor:
    """Random blocks of `ggml_type` with sane float16 scales (bytes 0-3 and the last 2)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = rng.uniform(0.002, 0.02, size=blocks.shape[:2] + (1,)).astype(np.float16)
    for offset in (0, 2, size - 2):
        blocks[..., offset:offset + 2] = halves.view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


def layer_weights(fmt: str, rng) -> list[dict]:
    layers = []
    for _ in range(LAYERS):
        weights = {}
        for name, (n, k) in SHAPES.items():
            if fmt in ("int4", "int8"):
                weights[name] = quantize(torch.randn(n, k) * 0.02, QuantSpec(fmt), max_rows=0)
            else:
                weights[name] = random_rows(GGMLQuantizationType[fmt], n, k, rng)
        layers.append(weights)
    return layers


def run_layer(ops, fmt: str, weights: dict, xs: dict, tiled: bool) -> None:
    for name, w in weights.items():
        x = xs[name]
        if fmt in ("int4", "int8"):
            mins = w.mins if w.mins is not None else torch.empty(0)
            if tiled:
                ops.quant_tiled_linear(x, w.data, w.scales, mins, 4 if fmt == "int4" else 8)
            elif fmt == "int4":
                ops.int4_linear(x.float(), w.data, w.scales, w.mins)
            else:
                ops.int8_linear(x.float(), w.data, w.scales)
        else:
            ops.gguf_linear(x, w, int(GGMLQuantizationType[fmt]), 0 if tiled else 1 << 30)


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K", "int4", "int8"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    ops = cpu_kernels()
    dtype = getattr(torch, args.dtype)
    print(f"CPU flags: {cpu_flags()}; threads {torch.get_num_threads()}; tiles in {args.dtype}")
    print("ms per layer (4 linears), few-row kernel / tiled path:")
    rng = np.random.default_rng(0)
    for fmt in args.formats:
        layers = layer_weights(fmt, rng)
        cells = []
        for rows in args.rows:
            xs = {name: torch.randn(rows, k).to(dtype) for name, (_, k) in SHAPES.items()}
            times = [best_ms(lambda f=fmt, x=xs, ls=layers, t=tiled:
                             [run_layer(ops, f, w, x, t) for w in ls], args.repeats) / LAYERS
                     for tiled in (False, True)]
            cells.append(f"{rows}: {times[0]:.2f} / {times[1]:.2f}")
        print(f"{fmt:>5}  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
