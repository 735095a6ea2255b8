"""Speculative decoding on and off, side by side: output tok/s on copy-heavy and open-ended
workloads, at one client and at many.

    python -m benchmarks.spec_decode                                 # default model, ngram k=7
    python -m benchmarks.spec_decode --rounds 2 \\
        --spec-config '{"method": "ngram", "num_speculative_tokens": 4}'
    python -m benchmarks.spec_decode --model TARGET --draft-model DRAFT   # draft_model, k=7

For each run (ABBA order over --rounds: off, on, on, off, ...) a pagedserve server is
started on 127.0.0.1 as `benchmarks.compare_servers` starts it, with or without
`--speculative-config`, warmed, and loaded by `benchmarks.serve` (chat endpoint, greedy):

  copy    COPY_PROMPTS one at a time: rewrite or repeat a given text, edit code and show
          all of it (the model stops at its own EOS, up to --copy-max-tokens); greedy
          outputs are the same with and without speculation, so the work is the same
  chat-1  open-ended: compare_servers' chat workload (random prompts of --input-len
          tokens, exactly --output-len tokens each), one client
  chat-N  the same at --clients clients

It prints one Markdown table: each workload's output tok/s off and on (mean over the
runs), on/off, and the draft acceptance the server's own pagedserve:spec_decode_* counters
report. The issue's bars: copy >= 2x, chat-1 >= 0.95x, chat-N >= 0.95x. Then, per copy
prompt, its seconds off and on and how much of its output the model really copied from
the prompt (a small model may explain or invent instead of copying: no guess helps
there), and the prompts whose output is at least half copied, together.

`--servers pagedserve llamacpp` also runs llama-server on the same GGUF, off and with its
own n-gram speculation (`--llamacpp-spec-args`, default `--spec-type ngram-simple`), in
the same ABBA order, after pagedserve's runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import httpx

from benchmarks import serve as bench_serve
from benchmarks.compare_servers import (
    DEFAULT_LLAMA_SERVER_BIN,
    abba_runs,
    bench_args,
    gguf_file,
    warmed_server,
)

# k = 7: a verification step of 8 rows costs about what one of 5 does on the CPU int4
# kernels (8-row blocks), and the adaptive draft length keeps rejected drafts short.
# llama-server's own n-gram speculation (its defaults: look up the last 12 tokens, draft
# up to 48), for the same workloads side by side with `--servers pagedserve llamacpp`.
DEFAULT_LLAMACPP_SPEC = "--spec-type ngram-simple"
DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, '
                '"prompt_lookup_max": 5}')

_PARAGRAPH = (
    "The paged KV cache stores the keys and values of every running request in fixed-size "
    "blocks. A block table maps each request's token positions to the blocks that hold "
    "them, so memory is allocated one block at a time, a finished request gives its blocks "
    "back at once, and requests that share a prompt prefix can share the blocks of that "
    "prefix instead of computing it again. When the cache is full, the scheduler preempts "
    "the request that arrived last and recomputes it later.")
_CODE = '''def moving_average(values, window):
    """Mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        averages.append(total / window)
    return averages
'''
_JSON = ('{"name": "pagedserve", "version": "0.1.0", "language": "Python", '
         '"features": ["paged attention", "prefix caching", "chunked prefill", '
         '"speculative decoding"], "license": "Apache-2.0"}')
COPY_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{_PARAGRAPH}",
    f"Rewrite this text with every 'request' replaced by 'job', changing nothing else:"
    f"\n\n{_PARAGRAPH}",
    f"Rename the variable `total` to `running_sum` in this code and show the whole "
    f"function:\n\n{_CODE}",
    f"Add a type hint to every parameter of this function and show all of it:\n\n{_CODE}",
    f"Format this JSON with one key per line, keeping every value:\n\n{_JSON}",
    f"Copy this code exactly, then explain it in one sentence:\n\n{_CODE}",
]


def write_copy_dataset(path: Path, max_tokens: int) -> None:
    with open(path, "w") as f:
        for prompt in COPY_PROMPTS:
            f.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")


def spec_counters(base_url: str) -> dict[str, float]:
    """The server's spec_decode_num_*_total counters (vLLM's names, which pagedserve and
    llama-server --metrics both export; 0 when speculation is off)."""
    totals = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    response = httpx.get(f"{base_url}/metrics", timeout=10)
    for line in response.text.splitlines() if response.status_code == 200 else ():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        for key in totals:
            if name in (f"pagedserve:spec_decode_num_{key}_total",
                        f"llamacpp:spec_decode_num_{key}_total"):
                totals[key] = float(line.rsplit(" ", 1)[1])
    return totals


def run_workload(args: argparse.Namespace, base_url: str, model_dir: str, label: str,
                 workload: str, copy_path: Path) -> dict:
    """One workload on a running server; its metrics plus the spec counters it moved."""
    result_file = str(Path(args.result_dir) / f"{label}-{workload}.json")
    if workload == "copy":
        argv = ["--base-url", base_url, "--endpoint", "chat", "--tokenizer", model_dir,
                "--dataset", "jsonl", "--dataset-path", str(copy_path),
                "--max-concurrency", "1", "--num-warmups", "0", "--no-ignore-eos",
                "--label", label, "--disable-tqdm", "--result-file", result_file,
                "--save-detailed"]
    else:
        clients = 1 if workload == "chat-1" else args.clients
        argv = bench_args(args, "pagedserve", base_url, model_dir, clients, result_file,
                          num_prompts=clients * args.prompts_per_client, num_warmups=0)
    before = spec_counters(base_url)
    if bench_serve.main(argv) != 0:
        raise RuntimeError(f"benchmark run {label} {workload} failed")
    after = spec_counters(base_url)
    with open(result_file) as f:
        record = json.load(f)
    metrics = record["metrics"]
    metrics["spec"] = {key: after[key] - before[key] for key in after}
    if workload == "copy":  # per prompt, in COPY_PROMPTS order (one client, in order)
        metrics["requests"] = [{key: r[key] for key in ("start_s", "end_s", "output_tokens",
                                                         "generated_text")}
                               for r in record["requests"]]
    return metrics


COPY_NGRAM = 4  # a copied output token lies in a 4-token window found in the prompt


def copied_share(tokenizer, prompt: str, output: str) -> float:
    """The share of the output's tokens that lie in some window of COPY_NGRAM consecutive
    output tokens that also occurs in the prompt: what prompt lookup can guess.

    Example, prompt tokens [a b c d e], output [x a b c d y]: the window [a b c d] occurs
    in the prompt, so 4 of 6 output tokens are copied (0.67)."""
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(output, add_special_tokens=False)
    grams = {tuple(prompt_ids[i:i + COPY_NGRAM]) for i in range(len(prompt_ids) - COPY_NGRAM + 1)}
    copied = [False] * len(output_ids)
    for i in range(len(output_ids) - COPY_NGRAM + 1):
        if tuple(output_ids[i:i + COPY_NGRAM]) in grams:
            copied[i:i + COPY_NGRAM] = [True] * COPY_NGRAM
    return sum(copied) / max(1, len(output_ids))


def report_copy_prompts(model_dir: str, server: str, server_runs: list[tuple[bool, dict]]
                        ) -> None:
    """Per copy prompt: output tokens, the share the output copies from its prompt, and
    its seconds (first byte sent to last byte received, so prefill included) off and on;
    then the prompts whose output is at least half copied, together."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    off = [r["copy"]["requests"] for s, r in server_runs if not s]
    on = [r["copy"]["requests"] for s, r in server_runs if s]

    def seconds(runs: list[list[dict]], i: int) -> float:
        return statistics.mean(run[i]["end_s"] - run[i]["start_s"] for run in runs)

    print(f"\n{server}, copy prompts one by one (seconds per request, mean over the runs):")
    print("| prompt | output tokens off / on | copied from the prompt | s off | s on | on / off |")
    print("|---|---|---|---|---|---|")
    copying = {"tokens": 0, "off": 0.0, "on": 0.0, "count": 0}
    for i, prompt in enumerate(COPY_PROMPTS):
        share = copied_share(tokenizer, prompt, off[0][i]["generated_text"])
        s_off, s_on = seconds(off, i), seconds(on, i)
        tokens = off[0][i]["output_tokens"]
        print(f"| {i + 1}. {prompt.splitlines()[0][:48]} | {tokens} / {on[0][i]['output_tokens']} "
              f"| {100 * share:.0f}% | {s_off:.2f} | {s_on:.2f} | {s_off / s_on:.2f}x |")
        if share >= 0.5:
            copying["tokens"] += tokens
            copying["off"] += s_off
            copying["on"] += s_on
            copying["count"] += 1
    if copying["count"]:
        print(f"Prompts whose output is at least half copied: {copying['count']} of "
              f"{len(COPY_PROMPTS)}, output tok/s {copying['tokens'] / copying['off']:.1f} off, "
              f"{copying['tokens'] / copying['on']:.1f} on "
              f"({copying['off'] / copying['on']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or .gguf (default: the SmolLM2 default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--spec-config", default=DEFAULT_SPEC,
                        help="the --speculative-config of the 'on' runs (JSON)")
    parser.add_argument("--draft-model", default=None,
                        help="speculate with this draft checkpoint instead (method "
                             "draft_model; --spec-config's other keys, e.g. "
                             "num_speculative_tokens, still apply)")
    parser.add_argument("--workloads", nargs="+", default=["copy", "chat-1", "chat-N"],
                        choices=["copy", "chat-1", "chat-N"])
    parser.add_argument("--clients", type=int, default=32, help="clients of chat-N")
    parser.add_argument("--prompts-per-client", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--copy-max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1,
                        help="pairs of runs (off, on), in ABBA order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18330)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default="results/spec_decode")
    parser.add_argument("--pagedserve-args", type=shlex.split, default=[],
                        help="extra flags for `pagedserve serve` (both modes), one quoted string")
    parser.add_argument("--servers", nargs="+", choices=["pagedserve", "llamacpp"],
                        default=["pagedserve"],
                        help="llamacpp: llama-server on the same GGUF (the default model's "
                        "or --model), off and with --llamacpp-spec-args")
    parser.add_argument("--llamacpp-spec-args", type=shlex.split,
                        default=shlex.split(DEFAULT_LLAMACPP_SPEC),
                        help="llama-server's speculation flags in the 'on' runs")
    parser.add_argument("--llama-server-bin", type=Path, default=DEFAULT_LLAMA_SERVER_BIN)
    args = parser.parse_args(argv)
    if min(args.clients, args.prompts_per_client, args.rounds, args.copy_max_tokens) < 1:
        parser.error("--clients, --prompts-per-client, --rounds, --copy-max-tokens must be >= 1")
    spec = json.loads(args.spec_config)  # fail now, not after the first server
    if args.draft_model is not None:
        spec.update(method="draft_model", model=str(Path(args.draft_model).resolve()))
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            spec.pop(key, None)
        args.spec_config = json.dumps(spec)

    from engine.model_loader import resolve_model

    model_dir = str(resolve_model(args.model).path)
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    copy_path = result_dir / "copy_prompts.jsonl"
    write_copy_dataset(copy_path, args.copy_max_tokens)
    gguf = gguf_file(args.model) if "llamacpp" in args.servers else None
    if "llamacpp" in args.servers and (gguf is None or not args.llama_server_bin.is_file()):
        parser.error("llamacpp needs a GGUF (the default model's or --model) and "
                     f"{args.llama_server_bin} (benchmarks/peers/setup_llamacpp.sh)")
    # compare_servers' llama-server command: one slot per client, room for a request each.
    args.concurrency, args.prefill_len = [args.clients], 0
    base_flags = list(args.pagedserve_args)
    runs: dict[str, list[tuple[bool, dict]]] = {}
    for server in args.servers:
        def run(label: str, speculate: bool, server: str = server) -> dict:
            args.pagedserve_args = base_flags + (
                ["--speculative-config", args.spec_config] if speculate else [])
            args.llamacpp_args = ["--metrics"] + (args.llamacpp_spec_args if speculate else [])
            with warmed_server(args, server, model_dir, gguf) as base_url:
                return {workload: run_workload(args, base_url, model_dir, f"{server}-{label}",
                                               workload, copy_path)
                        for workload in args.workloads}

        runs[server] = abba_runs(args.rounds, ("off", "on"), run)
    report(args, model_dir, runs)
    (result_dir / "summary.json").write_text(json.dumps(
        {"config": {k: v for k, v in vars(args).items()},
         "runs": {server: [{"speculate": s, "workloads": r} for s, r in server_runs]
                  for server, server_runs in runs.items()}}, indent=2, default=str))
    return 0


def report(args: argparse.Namespace, model_dir: str,
           runs: dict[str, list[tuple[bool, dict]]]) -> None:
    print(f"\n{model_dir}; {args.rounds} round(s); pagedserve speculation: {args.spec_config}"
          + (f"; llama-server: {shlex.join(args.llamacpp_spec_args)}"
             if "llamacpp" in runs else ""))
    print("| server | workload | output tok/s off | output tok/s on | on / off | drafts accepted "
          "| tokens per draft step | output tokens off / on |")
    print("|---|---|---|---|---|---|---|---|")
    for server, server_runs in runs.items():
        for workload in args.workloads:
            off = [r[workload] for s, r in server_runs if not s]
            on = [r[workload] for s, r in server_runs if s]
            off_tps = statistics.mean(m["output_throughput"] for m in off)
            on_tps = statistics.mean(m["output_throughput"] for m in on)
            spec = {key: sum(m["spec"][key] for m in on) for key in on[0]["spec"]}
            accepted = (f"{100 * spec['accepted_tokens'] / spec['draft_tokens']:.0f}% of "
                        f"{spec['draft_tokens']:.0f}" if spec["draft_tokens"] else "no drafts")
            per_step = (f"{1 + spec['accepted_tokens'] / spec['drafts']:.2f}"
                        if spec["drafts"] else "—")
            tokens = f"{off[0]['total_output_tokens']} / {on[0]['total_output_tokens']}"
            label = f"chat-{args.clients}" if workload == "chat-N" else workload
            print(f"| {server} | {label} | {off_tps:.1f} | {on_tps:.1f} | "
                  f"{on_tps / off_tps:.2f}x | {accepted} | {per_step} | {tokens} |")
    if "copy" in args.workloads:
        for server, server_runs in runs.items():
            report_copy_prompts(model_dir, server, server_runs)

if __name__ == "__main__":
    sys.exit(main())
