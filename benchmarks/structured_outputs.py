"""What do grammars cost? Throughput at 32 clients, every request constrained by a JSON
schema vs none, and the compile time of a typical schema.

    python -m benchmarks.structured_outputs                      # default model, 32 clients
    python -m benchmarks.structured_outputs --rounds 2 --output-len 128
    python -m benchmarks.structured_outputs --compile-only       # no server

One pagedserve server (started on 127.0.0.1 as `benchmarks.compare_servers` starts it)
serves the same `benchmarks.serve` workload (chat, random prompts, exactly --output-len
tokens each with ignore_eos, --clients at once) with and without
`response_format: json_schema` (CATALOG: an object holding an array of at least 64
{"name", "score"} objects, so no output can close before --output-len and both runs do
the same work). Runs go in ABBA order so a shared machine's drift cancels out. It prints
each run's output throughput, the ratio (the issue's goal: constrained >= 90% of free),
the compile time of PERSON (a typical nested schema) measured in this process (median of
--compile-repeats cold compiles), and the server's own grammar_compile_seconds.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks import serve as bench_serve
from benchmarks.compare_servers import (
    abba_runs,
    bench_args,
    check_output_tokens,
    warmed_pagedserve,
)

CATALOG = {
    "type": "object",
    "properties": {"items": {
        "type": "array", "minItems": 64,
        "items": {"type": "object",
                  "properties": {"name": {"type": "string"}, "score": {"type": "integer"}},
                  "required": ["name", "score"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role"], "additionalProperties": False,
}


def compile_times(model_dir: str, repeats: int) -> dict:
    """Cold compile of PERSON, and one 32-row bitmask fill + apply, in this process."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    from engine.structured_output import StructuredOutputsParams
    from engine.structured_output.backend import GrammarBackend, apply_bitmask

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    started = time.perf_counter()
    backend = GrammarBackend(tokenizer, vocab)
    vocab_table_s = time.perf_counter() - started
    params = StructuredOutputsParams("json", json.dumps(PERSON))
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        compiled = backend.compile(params)
        seconds.append(time.perf_counter() - started)
    matchers = [backend.matcher(compiled, None) for _ in range(32)]
    bitmask = backend.allocate_bitmask(32)
    logits = torch.randn(32, vocab)
    fills, applies = [], []
    for _ in range(20):
        started = time.perf_counter()
        for row, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        fills.append(time.perf_counter() - started)
        started = time.perf_counter()
        apply_bitmask(logits, bitmask, list(range(32)))
        applies.append(time.perf_counter() - started)
    return {"vocab_table_s": vocab_table_s, "compile_s_median": statistics.median(seconds),
            "compile_s_all": seconds, "fill_32_rows_ms": 1e3 * statistics.median(fills),
            "apply_32_rows_ms": 1e3 * statistics.median(applies)}


def server_compile_seconds(base_url: str) -> tuple[float, float]:
    """(sum, count) of the server's pagedserve:grammar_compile_seconds."""
    total = count = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedserve:grammar_compile_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("pagedserve:grammar_compile_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


def run_level(args: argparse.Namespace, base_url: str, model_dir: str, label: str,
              constrained: bool) -> dict:
    result_file = str(Path(args.result_dir) / f"{label}.json")
    argv = bench_args(args, "pagedserve", base_url, model_dir, args.clients, result_file,
                      num_prompts=args.clients * args.prompts_per_client, num_warmups=0)
    if constrained:
        argv += ["--extra-body", json.dumps({"response_format": {
            "type": "json_schema", "json_schema": {"name": "catalog", "schema": CATALOG}}})]
    if bench_serve.main(argv) != 0:
        raise RuntimeError(f"benchmark run {label} failed")
    with open(result_file) as f:
        metrics = json.load(f)["metrics"]
    check_output_tokens("pagedserve", metrics, args.output_len)
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or .gguf (default: the SmolLM2 default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompts-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2,
                        help="pairs of runs (free, constrained), in ABBA order")
    parser.add_argument("--compile-repeats", type=int, default=5)
    parser.add_argument("--compile-only", action="store_true",
                        help="only the in-process compile and mask timings (no server)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18320)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default="results/structured_outputs")
    parser.add_argument("--pagedserve-args", type=shlex.split, default=[],
                        help="extra flags for `pagedserve serve`, one quoted string")
    args = parser.parse_args(argv)
    if min(args.clients, args.prompts_per_client, args.rounds, args.compile_repeats) < 1:
        parser.error("--clients, --prompts-per-client, --rounds and --compile-repeats "
                     "must be at least 1")

    from engine.model_loader import resolve_model

    model_dir = str(resolve_model(args.model).path)
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    compile_report = compile_times(model_dir, args.compile_repeats)
    print(f"PERSON schema: cold compile {1e3 * compile_report['compile_s_median']:.1f} ms "
          f"(median of {args.compile_repeats}); vocabulary table "
          f"{compile_report['vocab_table_s']:.2f} s once; 32 rows: bitmask fill "
          f"{compile_report['fill_32_rows_ms']:.3f} ms, apply "
          f"{compile_report['apply_32_rows_ms']:.3f} ms per step", flush=True)
    summary: dict = {"compile": compile_report, "config": vars(args)}
    if not args.compile_only:
        summary.update(serve_runs(args, model_dir))
    (Path(args.result_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


def serve_runs(args: argparse.Namespace, model_dir: str) -> dict:
    with warmed_pagedserve(args, model_dir) as base_url:
        runs = abba_runs(args.rounds, ("free", "json_schema"),
                         lambda label, constrained: run_level(args, base_url, model_dir, label,
                                                              constrained))
        compile_sum, compile_count = server_compile_seconds(base_url)

    print(f"\n{args.clients} clients x {args.prompts_per_client} prompts, "
          f"{args.input_len} -> {args.output_len} tokens; {model_dir}")
    print("| run | response_format | output tok/s | requests/s | median TPOT ms |")
    print("|---|---|---|---|---|")
    for index, (constrained, m) in enumerate(runs):
        print(f"| {index + 1} | {'json_schema' if constrained else 'none'} | "
              f"{m['output_throughput']:.1f} | {m['request_throughput']:.2f} | "
              f"{m['tpot_ms']['median']:.1f} |")
    constrained_tps = statistics.mean(m["output_throughput"] for c, m in runs if c)
    free_tps = statistics.mean(m["output_throughput"] for c, m in runs if not c)
    ratio = constrained_tps / free_tps
    print(f"\nconstrained / free: {100 * ratio:.1f}% ({constrained_tps:.1f} vs {free_tps:.1f} "
          f"output tok/s; the goal is >= 90%)")
    if compile_count:
        print(f"server: {compile_count:.0f} grammar compile(s), "
              f"{1e3 * compile_sum / compile_count:.1f} ms each on average")
    return {"ratio": ratio, "constrained_tps": constrained_tps, "free_tps": free_tps,
            "server_compiles": compile_count, "server_compile_seconds": compile_sum,
            "runs": [{"constrained": c, "metrics": m} for c, m in runs]}


if __name__ == "__main__":
    sys.exit(main())
