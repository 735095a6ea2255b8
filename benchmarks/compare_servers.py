"""pagedserve against `transformers serve --continuous-batching`: one run, same client.

    python -m benchmarks.compare_servers                       # default model, fp32, 1/8/32 clients
    python -m benchmarks.compare_servers --dtype bfloat16 --concurrency 32

For each server in turn (never both at once): start it on 127.0.0.1 with the same
checkpoint directory and dtype, wait until it answers, send warm-up requests, run
`benchmarks.serve` (chat, random prompts, every request producing exactly
`--output-len` tokens) at each concurrency level with `--prompts-per-client`
requests per client, stop it. Then print one Markdown table with the date, the
machine and the commit, and write every level's JSON under `--result-dir`.

`transformers serve` needs `accelerate` on CPU (`pip install accelerate`) and an
ordinary checkpoint directory (it cannot read the default model's GGUF): both
servers get the directory pagedserve converts the GGUF into.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks import serve as bench_serve

SERVERS = ("pagedserve", "transformers")

# transformers serve rejects `ignore_eos`; its own generation_config field turns EOS off.
TRANSFORMERS_NO_EOS = ["--no-ignore-eos", "--extra-body",
                       json.dumps({"generation_config": json.dumps({"eos_token_id": -1})})]


@dataclass
class LevelResult:
    server: str
    concurrency: int
    metrics: dict


def server_command(name: str, model_dir: str, dtype: str, port: int,
                   extra: list[str]) -> list[str]:
    if name == "pagedserve":
        return [sys.executable, "-m", "server", "serve", "--model", model_dir, "--dtype", dtype,
                "--host", "127.0.0.1", "--port", str(port), *extra]
    cli = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
    return [cli, "serve", model_dir, "--continuous-batching", "--dtype", dtype,
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), *extra]


def wait_until_ready(base_url: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with status {process.returncode} before answering")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server at {base_url} did not answer within {timeout_s:.0f} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench_args(args: argparse.Namespace, name: str, base_url: str, model_dir: str,
               concurrency: int, result_file: str | None, num_prompts: int,
               num_warmups: int) -> list[str]:
    argv = [
        "--base-url", base_url, "--endpoint", "chat", "--tokenizer", model_dir,
        "--dataset", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--num-warmups", str(num_warmups), "--seed", str(args.seed), "--label", name,
        "--disable-tqdm",
    ]
    if result_file:
        argv += ["--result-file", result_file]
    if name == "transformers":
        argv += TRANSFORMERS_NO_EOS
    return argv


def run_server(args: argparse.Namespace, name: str, model_dir: str) -> list[LevelResult]:
    port = args.port
    base_url = f"http://127.0.0.1:{port}"
    extra = args.pagedserve_args if name == "pagedserve" else args.transformers_args
    command = server_command(name, model_dir, args.dtype, port, extra)
    log_path = Path(args.result_dir) / f"{name}-server.log"
    print(f"[{name}] {' '.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        results = []
        try:
            wait_until_ready(base_url, process, args.startup_timeout)
            # Warm-up at the highest level's width: lets a server build whatever it
            # builds lazily (transformers sets continuous batching up on first use).
            widest = max(args.concurrency)
            status = bench_serve.main(bench_args(args, name, base_url, model_dir, widest, None,
                                                 num_prompts=widest, num_warmups=1))
            if status != 0:
                raise RuntimeError(f"{name}: warm-up run failed")
            for concurrency in args.concurrency:
                result_file = str(Path(args.result_dir) / f"{name}-c{concurrency}.json")
                status = bench_serve.main(bench_args(
                    args, name, base_url, model_dir, concurrency, result_file,
                    num_prompts=concurrency * args.prompts_per_client, num_warmups=0))
                if status != 0:
                    raise RuntimeError(f"{name}: the run at {concurrency} clients failed")
                with open(result_file) as f:
                    results.append(LevelResult(name, concurrency, json.load(f)["metrics"]))
        finally:
            stop(process)
    return results


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown_table(args: argparse.Namespace, results: list[LevelResult]) -> str:
    def ms(stats: dict, key: str = "median") -> str:
        value = stats.get(key)
        return "—" if value is None else f"{value:,.0f}"

    lines = [
        f"{datetime.now(timezone.utc):%Y-%m-%d}, {machine_description()}, commit {commit()}; "
        f"chat, {args.input_len} random prompt tokens (plus the chat template), "
        f"{args.output_len} output tokens, {args.dtype}, "
        f"{args.prompts_per_client} requests per client.",
        "",
        "| server | clients | completed / failed | output tok/s | TTFT p50 (ms) | "
        "TTFT p99 (ms) | ITL p50 (ms) | TPOT p50 (ms) | E2EL p50 (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    label = {"pagedserve": "pagedserve",
             "transformers": "`transformers serve --continuous-batching`"}
    for r in results:
        m = r.metrics
        lines.append(
            f"| {label[r.server]} | {r.concurrency} | {m['completed']} / {m['failed']} | "
            f"{m['output_throughput']:.1f} | {ms(m['ttft_ms'])} | {ms(m['ttft_ms'], 'p99')} | "
            f"{ms(m['itl_ms'])} | {ms(m['tpot_ms'])} | {ms(m['e2el_ms'])} |"
        )
    by_key = {(r.server, r.concurrency): r.metrics for r in results}
    for concurrency in args.concurrency:
        ours, theirs = by_key.get(("pagedserve", concurrency)), by_key.get(
            ("transformers", concurrency))
        if ours and theirs and theirs["output_throughput"]:
            ratio = ours["output_throughput"] / theirs["output_throughput"]
            lines.append(f"\n{concurrency} clients: pagedserve / transformers output tok/s = "
                         f"{ratio:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the converted SmolLM2 default model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default="results/compare")
    parser.add_argument("--pagedserve-args", type=shlex.split, default=[],
                        help="extra flags for `pagedserve serve`, one quoted string")
    parser.add_argument("--transformers-args", type=shlex.split, default=[],
                        help="extra flags for `transformers serve`, one quoted string")
    args = parser.parse_args(argv)

    from engine.model_loader import resolve_model

    model_dir = str(resolve_model(args.model).path)
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    results: list[LevelResult] = []
    for name in args.servers:
        results += run_server(args, name, model_dir)
    table = markdown_table(args, results)
    print("\n" + table)
    (Path(args.result_dir) / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
