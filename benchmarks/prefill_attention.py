"""Attention of long bfloat16 prompt chunks: the AVX512-BF16 kernel
(pagedserve_kernels/cpu/prefill_attention.cpp) against torch's CPU flash kernel, per layer.

    python -m benchmarks.prefill_attention                       # the 1B Llama's shape
    python -m benchmarks.prefill_attention --heads 9 --kv-heads 3 --chunks 512:512 512:2048

Each `--chunks L:S` is a chunk of L query tokens that are the last L of S positions (L = S:
a prompt's first chunk; L < S: a chunk after cached context). Both sides get the same
bfloat16 q [L, Hq, D] and k/v [Hkv, S, D]; torch's side is the backend's own SDPA path
(engine/attention/backends/torch_backend.py) with the kernel switched off. Prints ms per
layer (best of --repeats), GFLOP/s (4 L S' D Hq, S' the keys each query sees on average)
and the largest difference between the two outputs.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.compare_servers import cpu_flags
from benchmarks.gguf_linears import best_ms
from engine.attention.backends import torch_backend
from pagedserve_kernels.cpu_kernels import prefill_attention_kernel


def attend(q, k, v, scores, kernel) -> torch.Tensor:
    """The backend's prefill attention with `kernel` (None: torch's flash kernel)."""
    original = torch_backend.prefill_attention_kernel
    torch_backend.prefill_attention_kernel = lambda: kernel
    try:
        return torch_backend._causal_attention(q, k, v, scores)
    finally:
        torch_backend.prefill_attention_kernel = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--chunks", nargs="+", default=["2048:2048", "1752:3800"],
                        help="L:S pairs (L query tokens, the last L of S positions)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = prefill_attention_kernel()
    print(f"CPU flags: {cpu_flags()}; {args.threads} threads")
    if kernel is None:
        print("no AVX512-BF16 prefill kernel in this build: torch's kernel serves every chunk")
        return
    scores = torch_backend.Scores(args.head_size ** -0.5)
    print("| chunk L:S | torch flash (ms) | GFLOP/s | prefill_attention.cpp (ms) | GFLOP/s | max |diff| |")
    print("|---|---|---|---|---|---|")
    for chunk in args.chunks:
        query_len, seq_len = (int(n) for n in chunk.split(":"))
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(query_len, args.heads, args.head_size, generator=gen).bfloat16()
        k = torch.randn(args.kv_heads, seq_len, args.head_size, generator=gen).bfloat16()
        v = torch.randn(args.kv_heads, seq_len, args.head_size, generator=gen).bfloat16()
        mean_keys = seq_len - query_len + (query_len + 1) / 2
        flops = 4 * query_len * mean_keys * args.head_size * args.heads
        theirs = best_ms(lambda q=q, k=k, v=v: attend(q, k, v, scores, None), args.repeats)
        ours = best_ms(lambda q=q, k=k, v=v: attend(q, k, v, scores, kernel), args.repeats)
        diff = (attend(q, k, v, scores, kernel).float()
                - attend(q, k, v, scores, None).float()).abs().max().item()
        print(f"| {chunk} | {theirs:.1f} | {flops / theirs / 1e6:.0f} | {ours:.1f} | "
              f"{flops / ours / 1e6:.0f} | {diff:.4f} |")


if __name__ == "__main__":
    main()
