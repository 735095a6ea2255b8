"""Decode speed over a long context, per KV-cache dtype (issue 39: the int8 KV cache).

    python -m benchmarks.long_context                        # 16k context: bfloat16 vs int8 KV
    python -m benchmarks.long_context --context 8192 --kv-cache-dtypes bfloat16 int8 float32

The model: SmolLM2-135M-Instruct's shape (30 layers, 9 query and 3 KV heads of 64, hidden
576, vocabulary 49,152, tied embeddings) with random weights and a context of
--context + 256 positions (the real model's is 8,192), its linears quantized to int4 at load
as the default model's GGUF is served, bfloat16 activations, SmolLM2's tokenizer. Timing does
not depend on the weights' values. Built once into --cache-dir.

One request per dtype, on a fresh engine: its prompt of --context random tokens is
prefilled once and stays in the prefix cache; then ITL = (time to generate 1 + N tokens -
time to generate 1 token) / N over that cached prompt, best of --repeats. Each engine's KV
bytes per token (all layers, K and V) are printed beside it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

# SmolLM2-135M-Instruct's shape (its rope theta, norm epsilon and tokenizer come from the
# default model's GGUF in build_checkpoint).
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             tie_word_embeddings=True, initializer_range=0.02)


def build_model(out_dir: Path, positions: int) -> Path:
    """A random SmolLM2-135M-shaped Llama with `positions` positions (bfloat16), once."""
    if not (out_dir / "config.json").exists():
        from benchmarks.peers.make_bench_gguf import build_checkpoint
        from engine.model_loader.source import default_model_gguf

        build_checkpoint(out_dir, default_model_gguf(), seed=0, shape=SHAPE, positions=positions)
    return out_dir


def decode_ms(model_dir: Path, prompt: list[int], kv_cache_dtype: str, new_tokens: int,
              repeats: int) -> tuple[float, int]:
    """(ms per decoded token over the cached prompt, KV bytes per token) for one dtype."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="bfloat16", quantization="int4",
              max_model_len=len(prompt) + new_tokens + 16, kv_cache_memory="2G",
              kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=2048)
    try:
        caches = llm.engine_core.executor.runner.kv_caches  # [2, Hkv, blocks, block, row]
        bytes_per_token = sum(c[:, :, 0, 0].numel() * c.element_size() for c in caches)

        def run(max_tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            return time.perf_counter() - start

        run(1)  # prefill: the prompt's blocks stay cached
        best = min((run(1 + new_tokens) - run(1)) for _ in range(repeats))
        return best / new_tokens * 1e3, bytes_per_token
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["bfloat16", "int8"])
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/pagedserve-bench"))
    args = parser.parse_args(argv)

    import numpy as np

    from benchmarks.compare_servers import cpu_flags

    positions = args.context + args.new_tokens + 256
    model_dir = build_model(args.cache_dir / f"smollm2-135m-shape-{positions}", positions)
    prompt = np.random.default_rng(0).integers(3, 49000, size=args.context).tolist()
    print(f"CPU flags: {cpu_flags()}")
    print(f"{model_dir.name}: one request, {args.context}-token cached prompt, "
          f"{args.new_tokens} new tokens, best of {args.repeats}")
    results = []
    for dtype in args.kv_cache_dtypes:
        ms, per_token = decode_ms(model_dir, prompt, dtype, args.new_tokens, args.repeats)
        results.append((dtype, ms, per_token))
        print(f"  --kv-cache-dtype {dtype:>8}: {ms:6.2f} ms per token "
              f"({per_token:,} KV bytes per token; {ms and results[0][1] / ms:.2f}x the first)",
              flush=True)


if __name__ == "__main__":
    main()
