"""Packed linears at each batch width: the few-row kernel against the tiled path.

    python -m benchmarks.gguf_linears                 # a 1B Llama layer's shapes, Q4_K/Q6_K/int4/int8
    python -m benchmarks.gguf_linears --rows 1 8 32 --dtype float32
    python -m benchmarks.gguf_linears --shapes lm_head --formats int8 int8-rowmajor --rows 1 4 8

For one decoder layer of a Llama with hidden 2048, intermediate 8192 and 8 KV heads of 64
(qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048, down 2048 x 8192), random weights in
each format, prints the best-of-N milliseconds of the four linears at each row count on
the few-row kernel (integer, batch invariant) and on the tiled path (decoded tiles and
one matmul in `--dtype`). The crossover is where `default_max_rows` (engine.models.quant)
should sit for this CPU; the weights of 8 layers are cycled so they come from memory, not
from the cache, as in a real forward pass. Prints the CPU's SIMD flags first.

int4 / int8 weights whose output count is a multiple of 16 (all of these) are held in
blocks of 16 output rows (pagedserve_kernels/cpu/quant_blocked.cpp), as the server holds them;
"int4-rowmajor" / "int8-rowmajor" run the same weights in quant_linear.cpp's row-major
layout for comparison. "Q4_K-repacked" / "Q6_K-repacked" (and Q3_K, Q5_K) are random K-quant weights as
the GGUF loader holds them (engine.models.gguf_weight.repack: blocked int4 / int8 with
super-block scales), "Q4_K" / "Q6_K" the same types on gguf_linear.cpp's kernels. `--shapes lm_head`: SmolLM2-135M's tied lm_head (49152 x 576,
Q8_0 in its GGUF, so int8) instead of the layer.

`--activations int16 int8` compares the few-row kernels' activation precisions
(PAGEDSERVE_ACTIVATION_PRECISION) in this one process: the precisions alternate call by call
(ABAB..., `--repeats` rounds, each one pass over the cycled layers), and each cell is the
median ms per layer of each precision and the median of the rounds' ratios, so that
another process's load shifts both alike:

    python -m benchmarks.gguf_linears --formats int4 Q4_K --rows 1 8 --activations int16 int8 --repeats 21
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from benchmarks.compare_servers import cpu_flags
from engine.models.gguf_weight import repack
from engine.models.quant import QuantSpec, quantize
from pagedserve_kernels.cpu_kernels import (
    ACTIVATION_PRECISIONS,
    activation_precision,
    cpu_kernels,
    set_activation_precision,
)

SHAPE_SETS = {
    "layer": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
              "down": (2048, 8192)},
    "lm_head": {"lm_head": (49152, 576)},
}
PACKED = ("int4", "int8", "int4-rowmajor", "int8-rowmajor")  # engine.models.quant formats
REPACKED = ("Q3_K-repacked", "Q4_K-repacked", "Q5_K-repacked", "Q6_K-repacked")  # GGUF repacks
LAYERS = 8  # copies of the weights, cycled so that they come from memory


def random_rows(ggml_type: GGMLQuantizationType, rows: int, cols: int, rng) -> torch.Tensor:
    """Random blocks of `ggml_type` with sane float16 scales (bytes 0-3 and the last 2)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    halves = rng.uniform(0.002, 0.02, size=blocks.shape[:2] + (1,)).astype(np.float16)
    for offset in (0, 2, size - 2):
        blocks[..., offset:offset + 2] = halves.view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


def packed_weight(fmt: str, n: int, k: int) -> tuple:
    """(data, scales, mins) of a random int4/int8 weight, blocked or ("-rowmajor") not."""
    w = quantize(torch.randn(n, k) * 0.02, QuantSpec(fmt.removesuffix("-rowmajor")), max_rows=0)
    return w.canonical() if fmt.endswith("-rowmajor") else (w.data, w.scales, w.mins)


def block_width(fmt: str) -> int:
    """Columns per block of a format (32 for int4/int8, the GGML type's block otherwise)."""
    if fmt in PACKED:
        return 32
    return GGML_QUANT_SIZES[GGMLQuantizationType[fmt.removesuffix("-repacked")]][0]


def layer_weights(fmt: str, shapes: dict, rng, copies: int = LAYERS) -> list[dict]:
    layers = []
    for _ in range(copies):
        weights = {}
        for name, (n, k) in shapes.items():
            if fmt in PACKED:
                weights[name] = packed_weight(fmt, n, k)
            elif fmt in REPACKED:
                ggml_type = GGMLQuantizationType[fmt.removesuffix("-repacked")]
                w = repack(random_rows(ggml_type, n, k, rng).numpy(), ggml_type, max_rows=0)
                weights[name] = (w.data, w.scales, w.mins)
            else:
                weights[name] = random_rows(GGMLQuantizationType[fmt], n, k, rng)
        layers.append(weights)
    return layers


def run_layer(ops, fmt: str, weights: dict, xs: dict, tiled: bool) -> None:
    for name, w in weights.items():
        x = xs[name]
        if fmt in PACKED or fmt in REPACKED:
            data, scales, mins = w
            int4 = fmt.startswith("int4") or fmt == "Q4_K-repacked"
            if tiled:
                ops.quant_tiled_linear(x, data, scales, torch.empty(0) if mins is None else mins,
                                       4 if int4 else 8)
            elif int4:
                ops.int4_linear(x.float(), data, scales, mins)
            else:
                ops.int8_linear(x.float(), data, scales, mins)  # mins: GGUF Q5_K only
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


def interleaved_ms(fn, precisions: list[str], repeats: int) -> dict[str, list[float]]:
    """Each precision's ms per call over `repeats` rounds, the precisions alternating
    within each round (after one warm-up call of each)."""
    for name in precisions:
        set_activation_precision(name)
        fn()
    times: dict[str, list[float]] = {name: [] for name in precisions}
    for i in range(repeats):
        order = precisions if i % 2 == 0 else precisions[::-1]  # ABBA: neither always first
        for name in order:
            set_activation_precision(name)
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def compare_precisions(ops, args, shapes: dict, dtype, rng) -> None:
    """The --activations table: few-row ms per layer of each precision, interleaved."""
    names = args.activations
    before = activation_precision()
    print(f"ms per {args.shapes} ({', '.join(shapes)}), few-row kernel, median of {args.repeats} "
          f"interleaved rounds: {' / '.join(names)}  (ratio {names[-1]} / {names[0]}: median of "
          f"the rounds' ratios)")
    for fmt in args.formats:
        block = block_width(fmt)
        if any(k % block for _, k in shapes.values()):
            print(f"{fmt:>13}  skipped: its blocks of {block} do not divide these shapes' K")
            continue
        layers = layer_weights(fmt, shapes, rng, args.layers)
        cells = []
        for rows in args.rows:
            xs = {name: torch.randn(rows, k).to(dtype) for name, (_, k) in shapes.items()}
            times = interleaved_ms(lambda f=fmt, x=xs, ls=layers:
                                   [run_layer(ops, f, w, x, False) for w in ls], names, args.repeats)
            medians = [float(np.median(times[n])) / args.layers for n in names]
            ratio = float(np.median(np.array(times[names[-1]]) / np.array(times[names[0]])))
            cells.append(f"{rows}: {' / '.join(f'{m:.3f}' for m in medians)} ({ratio:.2f}x)")
        print(f"{fmt:>13}  " + "   ".join(cells), flush=True)
    if before is not None:
        set_activation_precision(before)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K", "int4", "int8"],
                        help=f"GGML type names or {', '.join(PACKED + REPACKED)}")
    parser.add_argument("--shapes", default="layer", choices=sorted(SHAPE_SETS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=LAYERS,
                        help="copies of the weights cycled (fewer: a quick check, cached weights)")
    parser.add_argument("--activations", nargs="+", choices=sorted(ACTIVATION_PRECISIONS),
                        help="compare these few-row activation precisions, interleaved in this "
                             "process (default: the kernels' current one, few-row vs tiled)")
    args = parser.parse_args(argv)
    ops = cpu_kernels()
    shapes = SHAPE_SETS[args.shapes]
    dtype = getattr(torch, args.dtype)
    print(f"CPU flags: {cpu_flags()}; threads {torch.get_num_threads()}; tiles in {args.dtype}; "
          f"activations {' vs '.join(args.activations or [str(activation_precision())])}")
    rng = np.random.default_rng(0)
    if args.activations:
        compare_precisions(ops, args, shapes, dtype, rng)
        return
    print(f"ms per {args.shapes} ({', '.join(shapes)}), few-row kernel / tiled path:")
    for fmt in args.formats:
        block = block_width(fmt)
        if any(k % block for _, k in shapes.values()):
            print(f"{fmt:>13}  skipped: its blocks of {block} do not divide these shapes' K")
            continue
        layers = layer_weights(fmt, shapes, rng, args.layers)
        cells = []
        for rows in args.rows:
            xs = {name: torch.randn(rows, k).to(dtype) for name, (_, k) in shapes.items()}
            times = [best_ms(lambda f=fmt, x=xs, ls=layers, t=tiled:
                             [run_layer(ops, f, w, x, t) for w in ls], args.repeats) / args.layers
                     for tiled in (False, True)]
            cells.append(f"{rows}: {times[0]:.2f} / {times[1]:.2f}")
        print(f"{fmt:>13}  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
