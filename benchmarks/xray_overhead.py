"""Does watching slow serving? Throughput at 32 clients with one /xray viewer open vs none.

    python -m benchmarks.xray_overhead                          # default model, 32 clients
    python -m benchmarks.xray_overhead --rounds 3 --output-len 256

One pagedserve server (started on 127.0.0.1 the way `benchmarks.compare_servers` starts
it) serves the same `benchmarks.serve` workload (chat, random prompts, exactly
--output-len tokens each, --clients at once) again and again: without a viewer, and with
one viewer that does what the page does (GET /xray once, then GET /xray/state as often
as the server allows, at most 4 times a second), in its own process like a browser.
Runs go in ABBA order (off, on, on, off, ...) so that a slow drift of a shared machine
cancels out. It prints every run's output throughput and the ratio with/without (the
issue's bar is at least 98%), and writes every run's JSON under --result-dir.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
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

MAX_POLLS_PER_S = 4.0


def view(base_url: str, stop_event, results) -> None:
    """A viewer process: the page, then its state as often as the server allows; puts
    (polls, distinct snapshots seen) on `results` when `stop_event` is set."""
    polls = 0
    seqs = set()
    with httpx.Client(base_url=base_url, timeout=60.0, trust_env=False) as client:
        client.get("/xray").raise_for_status()
        interval_s = 1.0 / MAX_POLLS_PER_S
        while not stop_event.is_set():
            started = time.monotonic()
            state = client.get("/xray/state").json()
            polls += 1
            seqs.add(state["seq"])
            interval_s = max(1.0 / MAX_POLLS_PER_S, state["min_interval_s"])
            stop_event.wait(max(0.0, interval_s - (time.monotonic() - started)))
    results.put((polls, len(seqs)))


def run_level(args: argparse.Namespace, base_url: str, model_dir: str, label: str,
              with_viewer: bool) -> dict:
    """One benchmark run; returns its metrics plus what the viewer saw."""
    result_file = str(Path(args.result_dir) / f"{label}.json")
    argv = bench_args(args, "pagedserve", base_url, model_dir, args.clients, result_file,
                      num_prompts=args.clients * args.prompts_per_client, num_warmups=0)
    viewer = None
    if with_viewer:
        context = multiprocessing.get_context("spawn")
        stop_event, results = context.Event(), context.Queue()
        viewer = context.Process(target=view, args=(base_url, stop_event, results),
                                 daemon=True)
        viewer.start()
        time.sleep(1.0)  # the page is open before the load starts
    try:
        if bench_serve.main(argv) != 0:
            raise RuntimeError(f"benchmark run {label} failed")
    finally:
        if viewer is not None:
            stop_event.set()
    with open(result_file) as f:
        metrics = json.load(f)["metrics"]
    check_output_tokens("pagedserve", metrics, args.output_len)
    if viewer is not None:
        try:
            metrics["viewer_polls"], metrics["viewer_snapshots"] = results.get(timeout=60)
        except queue.Empty:
            raise RuntimeError("the viewer failed (a server with --no-xray?)") from None
        viewer.join(30)
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
                        help="pairs of runs (without, with a viewer), in ABBA order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18310)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default="results/xray_overhead")
    parser.add_argument("--pagedserve-args", type=shlex.split, default=[],
                        help="extra flags for `pagedserve serve`, one quoted string")
    args = parser.parse_args(argv)
    if min(args.clients, args.prompts_per_client, args.rounds) < 1:
        parser.error("--clients, --prompts-per-client and --rounds must be at least 1")

    from engine.model_loader import resolve_model

    model_dir = str(resolve_model(args.model).path)
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    with warmed_pagedserve(args, model_dir) as base_url:
        runs = abba_runs(args.rounds, ("none", "viewer"),
                         lambda label, with_viewer: run_level(args, base_url, model_dir, label,
                                                              with_viewer))

    print(f"\n{args.clients} clients x {args.prompts_per_client} prompts, "
          f"{args.input_len} -> {args.output_len} tokens; {model_dir}")
    print("| run | viewer | output tok/s | requests/s | viewer polls | snapshots seen |")
    print("|---|---|---|---|---|---|")
    for index, (with_viewer, m) in enumerate(runs):
        print(f"| {index + 1} | {'yes' if with_viewer else 'no'} | "
              f"{m['output_throughput']:.1f} | {m['request_throughput']:.2f} | "
              f"{m.get('viewer_polls', '')} | {m.get('viewer_snapshots', '')} |")
    with_tps = statistics.mean(m["output_throughput"] for v, m in runs if v)
    without_tps = statistics.mean(m["output_throughput"] for v, m in runs if not v)
    ratio = with_tps / without_tps
    print(f"\nwith a viewer / without: {100 * ratio:.1f}% "
          f"({with_tps:.1f} vs {without_tps:.1f} output tok/s; the bar is >= 98%)")
    summary = {"ratio": ratio, "with_viewer_tps": with_tps, "without_viewer_tps": without_tps,
               "runs": [{"viewer": v, "metrics": m} for v, m in runs], "config": vars(args)}
    (Path(args.result_dir) / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
