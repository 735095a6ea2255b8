"""Perplexity of a model on a text, llama.cpp's `llama-perplexity` protocol, per arithmetic path.

    python -m benchmarks.perplexity                                  # default model, GPL-3 text
    python -m benchmarks.perplexity --modes float32 int16 int8 --chunks 8
    python -m benchmarks.perplexity --text some.txt --model path/to/model.gguf

The protocol (llama.cpp tools/perplexity): the whole text is tokenized once (a BOS first
where the tokenizer adds one), cut into chunks of `--ctx` (512) tokens, each chunk is one
prompt (its first token replaced by BOS where the tokenizer adds one), and only the second
half is scored: the logits at positions ctx/2 .. ctx - 2 predict tokens ctx/2 + 1 .. ctx - 1
(255 per chunk of 512), so every scored token sees at least 256 tokens of context.
Perplexity = exp(mean negative log-likelihood over all scored tokens); the +/- is the
standard error of that mean, carried through the exp (llama-perplexity prints the same).

What each mode runs (one engine per mode, one after another in this process; the model's
packed weights are the same):
- `float32`: every linear on the tiled path (PAGEDSERVE_QUANT_MAX_ROWS=0): the packed
  weights decoded to float32 and one matmul with unrounded activations: the dense
  float32 model these weights stand for;
- `int16`, `int8`: every linear, prefill included, on the few-row integer kernels
  (PAGEDSERVE_QUANT_MAX_ROWS large) with activations rounded to that precision per group
  (PAGEDSERVE_ACTIVATION_PRECISION): the arithmetic a decode step runs, on every token.

`--prefill-attention kernel torch` (with `--dtype bfloat16`) runs each mode twice: long chunks
attending in prefill_attention.cpp (the default where the CPU has AVX512-BF16), then in
torch's flash kernel. `--kv-cache-dtypes auto int8` runs each mode over each KV-cache dtype. A prompt computed in
one step attends over its own unrounded keys and values (SDPA), so for the cache's rounding to
count the chunks are then prefilled `--prefill-chunk` tokens a step (default 32 with a
non-auto dtype): each step's rows read the cache, as decode steps do.

The default text is the GNU GPL version 3 as Debian ships it in every installation
(base-files: /usr/share/common-licenses/GPL-3, 35,149 bytes; ~7,900 tokens for SmolLM2, 15
chunks of 512): English prose that llama-perplexity can read from the same path.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
MODES = ("float32", "int16", "int8")
ALL_ROWS = 1 << 20  # PAGEDSERVE_QUANT_MAX_ROWS: every batch on the few-row kernels


@dataclass(frozen=True)
class Perplexity:
    mode: str  # the linears' mode, and the KV-cache dtype where not auto
    value: float
    stderr: float  # of the perplexity (from the NLL's standard error)
    num_scored: int
    seconds: float


def chunks_of(token_ids: list[int], ctx: int, bos_id: int | None,
              max_chunks: int | None) -> list[list[int]]:
    """The text's full chunks of `ctx` tokens, each starting with BOS when `bos_id` is set.
    Example, ctx 4, ids [9, 5, 6, 7, 8, 3, 4, 2, 1], bos 9: [[9, 5, 6, 7], [9, 3, 4, 2]]."""
    count = len(token_ids) // ctx
    if max_chunks is not None:
        count = min(count, max_chunks)
    chunks = [list(token_ids[i * ctx:(i + 1) * ctx]) for i in range(count)]
    if bos_id is not None:
        for chunk in chunks:
            chunk[0] = bos_id
    return chunks


def scored_logprobs(prompt_logprobs, ctx: int) -> list[float]:
    """The logprobs of tokens ctx/2 + 1 .. ctx - 1 (entry i: token i given tokens < i)."""
    return [prompt_logprobs[i].logprob for i in range(ctx // 2 + 1, ctx)]


def perplexity_of(logprobs: list[float]) -> tuple[float, float]:
    """(exp(mean NLL), its standard error through the exp)."""
    nll = [-lp for lp in logprobs]
    mean = sum(nll) / len(nll)
    variance = sum((v - mean) ** 2 for v in nll) / max(1, len(nll) - 1)
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(variance / len(nll))


def tokenize(tokenizer, text: str) -> tuple[list[int], int | None]:
    """(the text's ids, the BOS id when the tokenizer puts one first, else None)."""
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = getattr(tokenizer, "bos_token_id", None)
    plain = tokenizer.encode(text, add_special_tokens=False)
    adds_bos = bos is not None and len(ids) == len(plain) + 1 and ids[0] == bos
    return ids, bos if adds_bos else None


def run_mode(mode: str, model: str | None, chunks: list[list[int]], ctx: int,
             dtype: str, kv_cache_dtype: str = "auto",
             prefill_chunk: int | None = None, prefill_attention: str = "kernel") -> Perplexity:
    import pagedserve_kernels.cpu_kernels as ck
    from engine import LLM, SamplingParams
    from engine.attention.backends import torch_backend

    os.environ["PAGEDSERVE_QUANT_MAX_ROWS"] = "0" if mode == "float32" else str(ALL_ROWS)
    if mode != "float32":
        os.environ[ck.ACTIVATION_PRECISION_ENV] = mode
        ck.set_activation_precision(mode)
    # The engine runs in this process: "torch" hides the bf16 kernel from the backend.
    torch_backend.prefill_attention_kernel = (
        ck.prefill_attention_kernel if prefill_attention == "kernel" else lambda: None)
    start = time.perf_counter()
    chunked = {} if prefill_chunk is None else {"max_num_batched_tokens": prefill_chunk}
    llm = LLM(model, dtype=dtype, max_model_len=ctx + 16, kv_cache_memory="512M",
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype, **chunked)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        logprobs: list[float] = []
        for chunk in chunks:  # one at a time: each chunk's prefill is one batch of rows
            out = llm.generate([chunk], params, use_tqdm=False)[0]
            logprobs += scored_logprobs(out.prompt_logprobs, ctx)
    finally:
        llm.shutdown()
    value, stderr = perplexity_of(logprobs)
    label = mode if kv_cache_dtype == "auto" else f"{mode}/kv-{kv_cache_dtype}"
    if prefill_attention != "kernel":
        label += f"/{prefill_attention}-attention"
    return Perplexity(label, value, stderr, len(logprobs), time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or GGUF (default: SmolLM2)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=None, help="at most this many chunks")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"],
                        help="run each mode over each of these --kv-cache-dtype values")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="tokens prefilled a step (default: the engine's; 32 where a "
                             "--kv-cache-dtypes value is not auto)")
    parser.add_argument("--prefill-attention", nargs="+", choices=("kernel", "torch"),
                        default=["kernel"], help="long chunks' attention: the bf16 kernel "
                        "where the CPU has it, or torch's flash kernel (each mode runs each)")
    args = parser.parse_args(argv)
    prefill_chunk = args.prefill_chunk
    if prefill_chunk is None and any(d != "auto" for d in args.kv_cache_dtypes):
        prefill_chunk = 32

    from benchmarks.compare_servers import cpu_flags
    from engine.model_loader import resolve_model
    from engine.model_loader.resources import load_model_resources

    resolved = resolve_model(args.model)
    tokenizer = load_model_resources(resolved.path).tokenizer
    ids, bos = tokenize(tokenizer, args.text.read_text())
    chunks = chunks_of(ids, args.ctx, bos, args.chunks)
    if not chunks:
        raise SystemExit(f"{args.text}: {len(ids)} tokens, fewer than one chunk of {args.ctx}")
    print(f"CPU flags: {cpu_flags()}")
    print(f"{resolved.path.name}: {args.text} ({len(ids)} tokens, {len(chunks)} chunks of "
          f"{args.ctx}, second halves scored), {args.dtype}")
    if prefill_chunk is not None:
        print(f"prefilled {prefill_chunk} tokens a step: every scored row reads the KV cache")
    results = [run_mode(mode, args.model, chunks, args.ctx, args.dtype, kv, prefill_chunk,
                        attention)
               for mode in args.modes for kv in args.kv_cache_dtypes
               for attention in args.prefill_attention]
    base = results[0]
    for r in results:
        print(f"{r.mode:>8}  PPL = {r.value:.4f} +/- {r.stderr:.4f}  ({r.num_scored} tokens, "
              f"{(r.value / base.value - 1) * 100:+.2f}% vs {base.mode}, {r.seconds:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main()
