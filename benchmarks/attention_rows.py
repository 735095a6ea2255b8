"""The CPU paged-attention kernel's cost per layer for 1 and for several query rows of one
request: what a speculative verify step (1 + k rows) pays for attention.

    python -m benchmarks.attention_rows                     # SmolLM2's shape, 300 and 1000 keys
    python -m benchmarks.attention_rows --rows 1 4 8 --keys 300 --cache-dtype bfloat16
    python -m benchmarks.attention_rows --cold   # K/V from memory: a cache per layer

Calls `paged_attention` (pagedserve_kernels/cpu/paged_attention.cpp) directly on a random cache:
rows r of one request see keys 1..len like a prompt chunk (the last row all `--keys`).
Prints ms per layer (best of `--repeats` timings of `--calls` calls) and that times
`--layers`.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.compare_servers import cpu_flags


def time_rows(ops, rows: int, keys: int, args: argparse.Namespace, dtype: torch.dtype) -> float:
    """ms per call of `rows` query rows of one request whose last row sees `keys` keys;
    with --cold, each call reads the next of --layers caches, as a forward pass does."""
    num_blocks = -(-keys // args.block_size)
    caches = [torch.randn(2, args.kv_heads, num_blocks, args.block_size, args.head_size).to(dtype)
              for _ in range(args.layers if args.cold else 1)]
    table = torch.arange(num_blocks, dtype=torch.int32).reshape(1, num_blocks)
    query = torch.randn(rows, args.heads, args.head_size)
    out = torch.empty_like(query)
    row_tables = torch.zeros(rows, dtype=torch.int32)  # every row reads table row 0
    # Row j sees keys - rows + 1 + j keys: rows 8, keys 300 -> 293 .. 300.
    seq_lens = torch.arange(keys - rows + 1, keys + 1, dtype=torch.int32)
    scale = args.head_size ** -0.5
    for call in range(10):
        ops.paged_attention(out, query, caches[call % len(caches)], table, row_tables,
                            seq_lens, scale)
    best = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        for call in range(args.calls):
            ops.paged_attention(out, query, caches[call % len(caches)], table, row_tables,
                                seq_lens, scale)
        best = min(best, (time.perf_counter() - started) / args.calls)
    return best * 1e3


def main(argv: list[str] | None = None) -> dict[tuple[int, int], float]:
    """Prints the table; returns {(keys, rows): ms per layer}."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--keys", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--heads", type=int, default=9, help="query heads (SmolLM2: 9)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--cold", action="store_true",
                        help="a cache per layer, called in turn: K/V come from memory as in "
                             "a forward pass (by default one cache, which stays in the CPU's "
                             "caches: the kernel's compute alone)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or min(args.keys) < max(args.rows):
        parser.error("--rows must be >= 1 and every --keys at least the largest --rows")

    from pagedserve_kernels.cpu_kernels import cpu_kernels

    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("the C++ CPU kernels are not available (no compiler?)")
    dtype = getattr(torch, args.cache_dtype)
    print(f"CPU flags: {cpu_flags()}; threads {torch.get_num_threads()}; cache {args.cache_dtype}"
          + (f", one per layer ({args.layers}, --cold)" if args.cold else ", one (hot)"))
    print(f"ms per layer (x{args.layers} layers) for query rows of one request:")
    results = {}
    for keys in args.keys:
        cells = []
        for rows in args.rows:
            ms = results[keys, rows] = time_rows(ops, rows, keys, args, dtype)
            cells.append(f"{rows}: {ms:.3f} ({ms * args.layers:.2f})")
        print(f"  {keys:5d} keys  " + "   ".join(cells))
    return results


if __name__ == "__main__":
    main()
