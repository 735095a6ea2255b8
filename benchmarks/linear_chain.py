"""The chain of SmolLM2-135M's linears alone, per weight format and batch size.

    python -m benchmarks.linear_chain [--batches 1 8 16 32 128] [--threads 2]

30 x (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) + lm_head 49152x576,
random weights, no attention, no engine: what one decode step's matmuls cost at
best on this CPU. Formats: float32 and bfloat16 dense (F.linear), and the int8 /
int4 kernels of pagedserve_kernels/cpu/quant_linear.cpp (float32 activations). Prints ms per
step and tokens/s, with the CPU's flags, so that the crossover batch size where a
dense matmul beats the quantized kernel (engine.models.quant.default_max_rows)
can be read off for this machine.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine import cpu_info
from engine.models.quant import QuantSpec, quantize

HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def chain(kind: str):
    torch.manual_seed(0)
    shapes = SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    weights = [torch.randn(*shape) * 0.02 for shape in shapes]
    if kind in ("int4", "int8"):
        quantized = [quantize(w, QuantSpec(kind), max_rows=1 << 30) for w in weights]
        return shapes, lambda x, i: quantized[i].matmul(x, None)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    weights = [w.to(dtype) for w in weights]
    return shapes, lambda x, i: F.linear(x.to(dtype), weights[i])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32, 128])
    parser.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--threads", type=int, default=cpu_info.cpu_budget().num_threads)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_info.describe()}; torch {torch.__version__}, {args.threads} threads")
    print("| batch | " + " | ".join(args.formats) + " |")
    print("|---|" + "---|" * len(args.formats))
    results = {}
    for kind in args.formats:
        shapes, run = chain(kind)
        for batch in args.batches:
            inputs = {k: torch.randn(batch, k) for k in (HIDDEN, INTERMEDIATE)}
            with torch.inference_mode():
                for i, (_, k) in enumerate(shapes):
                    run(inputs[k], i)
                start = time.perf_counter()
                for _ in range(args.repeat):
                    for i, (_, k) in enumerate(shapes):
                        run(inputs[k], i)
            results[kind, batch] = (time.perf_counter() - start) / args.repeat
    for batch in args.batches:
        cells = [f"{results[k, batch] * 1e3:.1f} ms ({batch / results[k, batch]:.0f} tok/s)"
                 for k in args.formats]
        print(f"| {batch} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
