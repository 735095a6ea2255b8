"""Micro-benchmark: one sampler step (make_metadata + Sampler) at batch 64, vocab 49152.

    python -m benchmarks.sampler_step [--device cuda] [--batch 64] [--vocab 49152]

"peaked" logits are Zipf-like (a nucleus of tens to hundreds of tokens, as from
a trained LM); "flat" logits are N(0, 1), whose top-p nucleus spans most of the
vocab and forces the full-sort fallback (worst case).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine.sample import Sampler, SamplingState
from engine.sampling_params import SamplingParams


def peaked_logits(batch: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    base = -1.2 * ranks.log()  # Zipf, exponent 1.2
    rows = [base[torch.randperm(vocab, generator=generator)] for _ in range(batch)]
    return torch.stack(rows) + 0.3 * torch.randn(batch, vocab, generator=generator)


def bench(name, params, logits, device, iters, warmup=3) -> None:
    batch, vocab = logits.shape
    state = SamplingState(batch, vocab, device)
    for row in range(batch):
        state.add_request(row, params, [1, 2, 3], [], 0)
    rows = np.arange(batch)
    sampler = Sampler()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    meta_ms, sample_ms = [], []
    for i in range(warmup + iters):
        work = logits.clone()
        sync()
        t0 = time.perf_counter()
        md = state.make_metadata(rows)
        sync()
        t1 = time.perf_counter()
        sampler(work, md).sampled_token_ids.cpu()
        t2 = time.perf_counter()
        if i >= warmup:
            meta_ms.append((t1 - t0) * 1e3)
            sample_ms.append((t2 - t1) * 1e3)
    print(f"{name:34s} sampler {statistics.median(sample_ms):8.2f} ms   "
          f"make_metadata {statistics.median(meta_ms):6.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    peaked = peaked_logits(args.batch, args.vocab, generator).to(device)
    flat = torch.randn(args.batch, args.vocab, generator=generator).to(device)
    print(f"device={device} batch={args.batch} vocab={args.vocab} "
          f"threads={torch.get_num_threads()} (median of {args.iters})")
    top_p = SamplingParams(temperature=0.8, top_p=0.9)
    with torch.inference_mode():
        bench("all-greedy", SamplingParams(temperature=0.0), peaked, device, args.iters)
        bench("all-random temperature 0.8", SamplingParams(temperature=0.8), peaked, device,
              args.iters)
        bench("all-random top-p 0.9 (peaked)", top_p, peaked, device, args.iters)
        bench("all-random top-p 0.9 (flat)", top_p, flat, device, args.iters)
        bench("all-random top-k 50 + top-p 0.9", SamplingParams(temperature=0.8, top_k=50,
              top_p=0.9), peaked, device, args.iters)
        bench("all-greedy + logprobs 5", SamplingParams(temperature=0.0, logprobs=5), peaked,
              device, args.iters)


if __name__ == "__main__":
    main()
