"""Many LoRA adapters on one base against the base alone, on one server, in one run.

    python -m benchmarks.lora --model ~/.cache/pagedserve-peers/models/bench-llama-1b-Q4_K_M.gguf
    python -m benchmarks.lora --adapters 8 --rank 16 --clients 16 --rounds 3   # the defaults

The workload (issue 44): `--adapters` random rank-`--rank` adapters on every linear of
the base (PEFT files written here, float16), served with `--enable-lora --max-loras
<adapters>`. Levels, each through benchmarks/serve.py (random prompts of --input-len
tokens, --output-len tokens back, streamed): `--clients` clients on the base and the same
spread evenly over the adapters (request i names adapter i mod N), then one client on the
base and one on an adapter. Each pair runs back to back, the order flipped every round
(ABBA), `--rounds` times, so the machine's drift between rounds does not enter a ratio.
Reported: output tok/s and ITL p50 per level, each round's adapter level over its base
level and the median of those, and the time to load a fresh adapter: the server's check
(POST /v1/load_lora_adapter) and the worker's first use (the first request's TTFT over a
second one's of the same length).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from benchmarks import serve
from benchmarks.compare_servers import (
    commit,
    cpu_flags,
    machine_description,
    stop,
    wait_until_ready,
)
from engine.lora.checkpoint import base_linear_shape

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                 "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp",
                 "down_proj": "mlp"}


@dataclass
class Level:
    name: str  # "base" or "adapters"
    clients: int
    round_index: int
    output_tok_s: float
    itl_p50_ms: float
    failed: int


def write_adapter(hf_config, out_dir: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter of `rank` on every linear of each layer (A, B ~ N(0, 0.02))."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for target in TARGETS:
            out, inp = base_linear_shape(hf_config, target)
            key = f"base_model.model.model.layers.{layer}.{MODULE_PARENT[target]}.{target}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, inp)).astype(np.float16)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (out, rank)).astype(np.float16)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS), "bias": "none"}))
    return out_dir


def text_config(model: str):
    from transformers import AutoConfig

    from engine.model_loader.gguf import ensure_converted

    path = ensure_converted(model) if model.endswith(".gguf") else model
    return AutoConfig.from_pretrained(path).get_text_config(), str(path)


def level(args, base_url: str, tokenizer: str, name: str, clients: int,
          models: list[str] | None, result_dir: Path, round_index: int) -> Level:
    """One level through benchmarks/serve.py. The prompts are the round's (seed + round):
    the base and the adapters get the same ones, and no round hits an earlier round's
    prefix cache."""
    label = f"{name}-{clients}-round{round_index}"
    argv = ["--base-url", base_url, "--endpoint", "completions", "--tokenizer", tokenizer,
            "--dataset", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(max(3, 2 * clients)), "--max-concurrency", str(clients),
            "--num-warmups", str(args.adapters if clients > 1 else 1),  # alike for both
            "--seed", str(args.seed + round_index),
            "--disable-tqdm", "--label", label,
            "--result-file", str(result_dir / f"{label}.json")]
    argv += ["--lora-modules", *models] if models else ["--model", "base"]
    if serve.main(argv) != 0:
        raise RuntimeError(f"level {label} failed")
    metrics = json.loads((result_dir / f"{label}.json").read_text())["metrics"]
    return Level(name, clients, round_index, metrics["output_throughput"],
                 metrics["itl_ms"]["median"], metrics["failed"])


def load_time(base_url: str, path: Path, input_len: int) -> tuple[float, float]:
    """(seconds of POST /v1/load_lora_adapter, seconds the first request's TTFT is over a
    second one's): the server's check, then the worker reading the weights."""
    start = time.perf_counter()
    response = httpx.post(base_url + "/v1/load_lora_adapter", timeout=600,
                          json={"lora_name": "fresh", "lora_path": str(path)})
    response.raise_for_status()
    check_s = time.perf_counter() - start

    def ttft(first_token: int) -> float:
        prompt = [first_token + i % 97 for i in range(input_len)]  # no prefix-cache hit
        begin = time.perf_counter()
        out = httpx.post(base_url + "/v1/completions", timeout=600, json={
            "model": "fresh", "prompt": prompt, "max_tokens": 1, "temperature": 0})
        out.raise_for_status()
        return time.perf_counter() - begin

    first, second = ttft(1000), ttft(3000)
    return check_s, first - second


def markdown(args, levels: list[Level], check_s: float, load_s: float) -> str:
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d}, {machine_description()}, "
             f"flags: {cpu_flags()}, commit {commit()}; {Path(args.model).name}, "
             f"{args.adapters} rank-{args.rank} adapters on every linear, prompts "
             f"{args.input_len} tokens, {args.output_len} out, {args.rounds} rounds "
             "(base and adapters back to back, the order flipped each round; the ratios are "
             "each round's, then their median)", "",
             "| clients | round | base tok/s | adapters tok/s | ratio | base ITL p50 ms | "
             "adapters ITL p50 ms | ratio | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for clients in sorted({lv.clients for lv in levels}, reverse=True):
        tok_ratios, itl_ratios = [], []
        for round_index in sorted({lv.round_index for lv in levels}):
            pair = {lv.name: lv for lv in levels
                    if lv.clients == clients and lv.round_index == round_index}
            base, lora = pair["base"], pair["adapters"]
            tok_ratios.append(lora.output_tok_s / base.output_tok_s)
            itl_ratios.append(lora.itl_p50_ms / base.itl_p50_ms)
            lines.append(f"| {clients} | {round_index} | {base.output_tok_s:.1f} | "
                         f"{lora.output_tok_s:.1f} | {tok_ratios[-1]:.2f}x | "
                         f"{base.itl_p50_ms:.1f} | {lora.itl_p50_ms:.1f} | "
                         f"{itl_ratios[-1]:.2f}x | {base.failed + lora.failed} |")
        lines.append(f"| {clients} | median | | | **{np.median(tok_ratios):.2f}x** | | | "
                     f"**{np.median(itl_ratios):.2f}x** | |")
    lines += ["", f"Loading a fresh rank-{args.rank} adapter: the server's check "
              f"{check_s * 1000:.0f} ms, the worker's first use {load_s * 1000:.0f} ms."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the base: a .gguf file or checkpoint")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8431)
    parser.add_argument("--pagedserve-args", nargs=argparse.REMAINDER, default=[],
                        help="more `serve` flags (last on the line)")
    parser.add_argument("--json", help="write the levels and load times here")
    args = parser.parse_args(argv)

    hf_config, tokenizer = text_config(args.model)
    work = Path(tempfile.mkdtemp(prefix="pagedserve-lora-bench-"))
    names = [f"a{i}" for i in range(args.adapters)]
    modules = [f"{name}={write_adapter(hf_config, work / name, args.rank, seed=i)}"
               for i, name in enumerate(names)]
    fresh = write_adapter(hf_config, work / "fresh", args.rank, seed=args.adapters)
    base_url = f"http://127.0.0.1:{args.port}"
    command = [sys.executable, "-m", "server", "serve", "--model", args.model,
               "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(args.port),
               "--enable-lora", "--max-loras", str(args.adapters),
               "--max-cpu-loras", str(args.adapters + 1), "--max-lora-rank", str(args.rank),
               "--lora-modules", " ".join(modules), "--allow-runtime-lora-updating",
               *args.pagedserve_args]
    print(" ".join(command), file=sys.stderr)
    with open(work / "server.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    levels: list[Level] = []
    try:
        wait_until_ready(base_url, process, 900)
        for round_index in range(args.rounds):
            for clients in (args.clients, 1):
                order = [("base", None), ("adapters", names if clients > 1 else names[:1])]
                for name, models in order[::-1] if round_index % 2 else order:
                    levels.append(level(args, base_url, tokenizer, name, clients, models,
                                        work, round_index))
                    print(levels[-1], file=sys.stderr)
        check_s, load_s = load_time(base_url, fresh, args.input_len)
    finally:
        stop(process)
    print(markdown(args, levels, check_s, load_s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"levels": [lv.__dict__ for lv in levels], "check_s": check_s,
                       "load_s": load_s}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
