"""Vision chat: pagedserve against llama.cpp's `llama-server --mmproj`, one run, same workload.

    python -m benchmarks.vision                                   # both, 5 repeats, 8 clients
    python -m benchmarks.vision --servers pagedserve --repeats 2
    python -m benchmarks.vision --model-dir DIR --dtype float32 --gguf-outtype f32

The model: a random SmolVLM-256M-Instruct-shaped Idefics3 checkpoint (benchmarks/vlm_model.py:
SigLIP-B/16 at 512 px, scale_factor 4 -> 64 tokens a tile, images resized to 2048 px and
split into 512-px tiles; SmolLM2-135M text model and its real tokenizer), built into
`--model-dir` when missing (default ~/.cache/pagedserve-peers/models/smolvlm-256m-random);
llama-server gets the same weights converted by llama.cpp's convert_hf_to_gguf.py, the text
model and the projector (`--mmproj`), `--gguf-outtype` (f16), into DIR/gguf.

The workload: chat requests of one image (an OpenAI `image_url` part, a base64 PNG data URL)
and the question "Describe this image.", greedy, `max_tokens` 32 with `ignore_eos` (both
servers honour it; the random model's lm_head only ever picks plain words, so every token
streams as text and none is EOS; each request's output count is checked from `usage`),
streamed. Images: deterministic synthetic photos (gradients, a few shapes, noise), 640x480 by
default -> 2048x1536 -> 4 x 3 tiles + a global tile = 832 image tokens; every image is
different, the same set for every server. For each server in turn (never two at once):
start it on 127.0.0.1, wait until it answers, warm it with one image (and its re-send), then

    cold      `--repeats` requests one at a time, each with an image the server has never
              seen: time to first token (TTFT) = request sent -> first content chunk
    cached    each cold request re-sent right after it (same image and question): the
              prefix cache (and, for pagedserve, the encoder cache) at work
    clients   `--clients` concurrent streams, each sending `--requests-per-client` requests
              in turn, every one a fresh image: wall time, output tok/s and requests/s
              over the wall time, mean and median TTFT

then stop it. Prints one Markdown table (server, cold TTFT p50, cached TTFT p50,
cached/cold, clients' output tok/s and req/s, prompt tokens per request as each server
counts them, in `usage.prompt_tokens`) with the date, the CPU's SIMD flags, the model's
shape and the commit, and the goal ratios of issue 42 (pagedserve's cold TTFT <= 1x
llama-server's; pagedserve's cached TTFT <= 0.3x its cold one). Every request's record
goes to `--result-dir`/vision.json, the table to table.md, each server's log beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks import vlm_model
from benchmarks.compare_servers import (
    DEFAULT_LLAMA_SERVER_BIN,
    commit,
    cpu_flags,
    group_rss_mib,
    machine_description,
    stop,
    wait_until_ready,
)
from benchmarks.serve import parse_chunk

SERVERS = ("pagedserve", "llamacpp")
LABELS = {"pagedserve": "pagedserve", "llamacpp": "llama.cpp `llama-server --mmproj`"}
QUESTION = "Describe this image."
# llama-server splits --ctx-size among its --parallel slots: room for one request a slot
# (a 4 x 4-tile image is 17 x 64 + 50 tokens).
LLAMACPP_SLOT_CTX = 2048
# Image seeds: the warm-up, the cold requests and the clients' never overlap.
WARMUP_SEED, COLD_SEED, CLIENTS_SEED = 10_000, 20_000, 30_000


# ---------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------


def synthetic_photo(seed: int, width: int, height: int):
    """A deterministic RGB "photo": a two-colour gradient at a random angle, a few soft
    discs and rectangles, and sensor-like noise (PIL image)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, np.pi)
    ramp = (x * np.cos(angle) + y * np.sin(angle))
    ramp = (ramp - ramp.min()) / max(float(np.ptp(ramp)), 1.0)
    top, bottom = rng.uniform(0, 255, size=(2, 3)).astype(np.float32)
    pixels = top + ramp[..., None] * (bottom - top)
    for _ in range(int(rng.integers(3, 7))):
        colour = rng.uniform(0, 255, size=3).astype(np.float32)
        cx, cy = rng.uniform(0, width), rng.uniform(0, height)
        r = rng.uniform(0.05, 0.25) * min(width, height)
        if rng.random() < 0.5:
            inside = ((x - cx) ** 2 + (y - cy) ** 2) < r**2
        else:
            inside = (abs(x - cx) < r) & (abs(y - cy) < 0.6 * r)
        pixels[inside] = 0.3 * pixels[inside] + 0.7 * colour
    pixels += rng.normal(0, 12, size=pixels.shape).astype(np.float32)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def image_data_url(seed: int, width: int, height: int) -> str:
    buffer = io.BytesIO()
    synthetic_photo(seed, width, height).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def image_token_count(model_dir: Path, width: int, height: int) -> int | None:
    """The image tokens the checkpoint's processor writes for one width x height image."""
    try:
        from transformers import AutoConfig, AutoProcessor

        processor = AutoProcessor.from_pretrained(str(model_dir))
        image_token_id = AutoConfig.from_pretrained(str(model_dir)).image_token_id
        out = processor(text=[processor.image_token], images=[[synthetic_photo(0, width, height)]],
                        add_special_tokens=False)
        return int(sum(1 for t in out["input_ids"][0] if t == image_token_id))
    except Exception as exc:  # only a figure for the table's header
        print(f"[images] cannot count the image tokens: {exc}", flush=True)
        return None


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


@dataclass
class Record:
    phase: str  # warmup, cold, cached, clients
    index: int  # the request's index in its phase (clients: client * per_client + r)
    image_seed: int
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0  # perf_counter
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""


def chat_body(model: str, url: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTION}]}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }


async def send(client: httpx.AsyncClient, base_url: str, body: dict[str, Any],
               record: Record) -> Record:
    """One streaming chat request into `record` (never raises for a request's failure)."""
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    record.start_s = start = time.perf_counter()
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace").strip()
                raise RuntimeError(f"HTTP {resp.status_code}: {text[:500]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    continue
                text, chunk_usage = parse_chunk(json.loads(data), "chat")
                if chunk_usage:
                    usage = chunk_usage
                if text:
                    if record.ttft_ms is None:
                        record.ttft_ms = (time.perf_counter() - start) * 1000
                    pieces.append(text)
        record.e2e_ms = (time.perf_counter() - start) * 1000
        if record.ttft_ms is None:
            raise RuntimeError("the stream ended without any generated text")
        if not usage:
            raise RuntimeError("the stream carried no usage")
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
        record.ok = True
    except Exception as exc:  # recorded; the phase's summary reports it
        record.error = f"{type(exc).__name__}: {exc}"
    record.text = "".join(pieces)
    return record


def new_client() -> httpx.AsyncClient:
    # No keep-alive: llama-server closes connections idle for 5 s, and a request sent on
    # one just closed fails (as in compare_servers).
    return httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=10.0),
                             limits=httpx.Limits(max_keepalive_connections=0))


async def model_id(base_url: str) -> str:
    async with new_client() as client:
        resp = await client.get(f"{base_url}/v1/models")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])


async def run_workload(args: argparse.Namespace, base_url: str,
                       urls: dict[int, str]) -> tuple[list[Record], float]:
    """Warm-up, cold + cached pairs one at a time, then the clients' burst. Returns every
    record and the burst's wall time (s)."""
    model = await model_id(base_url)
    records: list[Record] = []
    async with new_client() as client:
        for phase in ("warmup", "warmup"):  # an image, then its re-send
            body = chat_body(model, urls[WARMUP_SEED], args.max_tokens)
            records.append(await send(client, base_url, body, Record(phase, 0, WARMUP_SEED)))
        for i in range(args.repeats):
            seed = COLD_SEED + i
            body = chat_body(model, urls[seed], args.max_tokens)
            for phase in ("cold", "cached"):
                record = await send(client, base_url, body, Record(phase, i, seed))
                records.append(record)
                print(f"  {phase:6} {i}: TTFT {fmt_ms(record.ttft_ms)} ms, prompt tokens "
                      f"{record.prompt_tokens} (cached {record.cached_tokens})"
                      + (f", FAILED {record.error}" if not record.ok else ""), flush=True)

        async def one_client(c: int) -> list[Record]:
            done = []
            for r in range(args.requests_per_client):
                index = c * args.requests_per_client + r
                seed = CLIENTS_SEED + index
                body = chat_body(model, urls[seed], args.max_tokens)
                done.append(await send(client, base_url, body, Record("clients", index, seed)))
            return done

        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(args.clients)))
        wall_s = time.perf_counter() - start
    for done in per_client:
        records.extend(done)
    return records, wall_s


# ---------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------


def server_command(args: argparse.Namespace, name: str, model_dir: Path,
                   gguf: tuple[Path, Path] | None) -> list[str]:
    loopback = ["--host", "127.0.0.1", "--port", str(args.port)]
    if name == "pagedserve":
        return [sys.executable, "-m", "server.http.cli", "serve", str(model_dir),
                "--dtype", args.dtype, *loopback, *args.pagedserve_args]
    assert gguf is not None
    text, mmproj = gguf
    return [str(args.llama_server_bin), "-m", str(text), "--mmproj", str(mmproj), *loopback,
            "-t", str(args.threads), "--parallel", str(args.clients),
            "--ctx-size", str(args.clients * LLAMACPP_SLOT_CTX), *args.llamacpp_args]


@dataclass
class ServerResult:
    name: str
    command: list[str]
    weights: str
    records: list[Record] = field(default_factory=list)
    clients_wall_s: float | None = None
    rss_after_load_mib: float | None = None
    rss_after_run_mib: float | None = None
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def run_server(args: argparse.Namespace, name: str, model_dir: Path,
               gguf: tuple[Path, Path] | None, urls: dict[int, str]) -> ServerResult:
    command = server_command(args, name, model_dir, gguf)
    weights = (f"{args.dtype} safetensors" if name == "pagedserve"
               else f"GGUF {args.gguf_outtype} + mmproj {args.gguf_outtype}")
    result = ServerResult(name, command, weights)
    base_url = f"http://127.0.0.1:{args.port}"
    log_path = Path(args.result_dir) / f"{name}-server.log"
    print(f"[{name}] {shlex.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            wait_until_ready(base_url, process, args.startup_timeout)
            result.rss_after_load_mib = group_rss_mib(process.pid)
            result.records, result.clients_wall_s = asyncio.run(
                run_workload(args, base_url, urls))
            result.rss_after_run_mib = group_rss_mib(process.pid)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc} (log: {log_path})"
            print(f"[{name}] FAILED: {result.error}", flush=True)
        finally:
            stop(process)
    result.summary = summarize(args, result)
    return result


# ---------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def fmt_ms(value: float | None) -> str:
    return fmt(value, ",.0f")


def summarize(args: argparse.Namespace, result: ServerResult) -> dict[str, Any]:
    def phase(name: str) -> list[Record]:
        return [r for r in result.records if r.phase == name]

    summary: dict[str, Any] = {}
    failures = [r for r in result.records if not r.ok]
    short = [r for r in result.records if r.ok and r.completion_tokens != args.max_tokens]
    summary["failed"] = len(failures)
    summary["errors"] = sorted({r.error for r in failures if r.error})[:5]
    summary["wrong_output_len"] = len(short)  # stopped early or overshot: not the same work
    for name in ("cold", "cached", "clients"):
        ok = [r for r in phase(name) if r.ok]
        summary[name] = {
            "requests": len(phase(name)), "ok": len(ok),
            "ttft_ms_p50": median([r.ttft_ms for r in ok]),
            "ttft_ms_mean": statistics.fmean([r.ttft_ms for r in ok]) if ok else None,
            "e2e_ms_p50": median([r.e2e_ms for r in ok]),
            "prompt_tokens": sorted({r.prompt_tokens for r in ok}),
            "cached_tokens": sorted({r.cached_tokens for r in ok if r.cached_tokens is not None}),
        }
    cold, cached = summary["cold"]["ttft_ms_p50"], summary["cached"]["ttft_ms_p50"]
    summary["cached_over_cold"] = cached / cold if cold and cached else None
    clients = [r for r in phase("clients") if r.ok]
    wall = result.clients_wall_s
    if clients and wall:
        summary["clients"]["wall_s"] = wall
        summary["clients"]["output_tokens"] = sum(r.completion_tokens or 0 for r in clients)
        summary["clients"]["output_tok_s"] = summary["clients"]["output_tokens"] / wall
        summary["clients"]["requests_s"] = len(clients) / wall
    return summary


def prompt_tokens_cell(summary: dict[str, Any]) -> str:
    tokens = summary["cold"]["prompt_tokens"] or summary["clients"]["prompt_tokens"]
    text = "/".join(str(t) for t in tokens) or "—"
    cached = summary["cached"]["cached_tokens"]
    if cached:
        text += f" ({'/'.join(str(t) for t in cached)} cached on the re-send)"
    return text


def markdown_table(args: argparse.Namespace, results: list[ServerResult],
                   image_tokens: int | None) -> str:
    tiles = f"{image_tokens} image tokens by the checkpoint's processor" if image_tokens else ""
    lines = [
        f"{datetime.now(timezone.utc):%Y-%m-%d}, {machine_description()}, commit {commit()}; "
        f"CPU flags: {cpu_flags()}.",
        f"Model: {vlm_model.shape_summary()} ({args.model_dir}).",
        f"Workload: one {args.image_size[0]}x{args.image_size[1]} PNG ({tiles}) + "
        f"\"{QUESTION}\", {args.max_tokens} output tokens (EOS ignored), greedy, streamed; "
        f"cold and cached TTFT: median of {args.repeats}, one request at a time; "
        f"{args.clients} clients x {args.requests_per_client} requests, every image fresh.",
        "",
        f"| server | weights | cold TTFT p50 (ms) | cached TTFT p50 (ms) | cached/cold | "
        f"{args.clients}-client output tok/s | {args.clients}-client req/s | "
        f"{args.clients}-client TTFT mean (ms) | {args.clients}-client wall (s) | "
        f"prompt tokens per request | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        s, c = r.summary, r.summary["clients"]
        cells = [LABELS[r.name], r.weights, fmt_ms(s["cold"]["ttft_ms_p50"]),
                 fmt_ms(s["cached"]["ttft_ms_p50"]), fmt(s.get("cached_over_cold"), ".3f"),
                 fmt(c.get("output_tok_s"), ".1f"), fmt(c.get("requests_s"), ".2f"),
                 fmt_ms(c["ttft_ms_mean"]), fmt(c.get("wall_s"), ".1f"),
                 prompt_tokens_cell(s), str(s["failed"])]
        lines.append("| " + " | ".join(cells) + " |")
    by_name = {r.name: r.summary for r in results}
    ours, theirs = by_name.get("pagedserve"), by_name.get("llamacpp")
    goals = []
    if ours and theirs and ours["cold"]["ttft_ms_p50"] and theirs["cold"]["ttft_ms_p50"]:
        ratio = ours["cold"]["ttft_ms_p50"] / theirs["cold"]["ttft_ms_p50"]
        goals.append(f"pagedserve's cold TTFT = {ratio:.2f}x llama-server's (goal <= 1x)")
    if ours and ours.get("cached_over_cold") is not None:
        goals.append(f"pagedserve's cached TTFT = {ours['cached_over_cold']:.2f}x its cold "
                     "(goal <= 0.3x)")
    if ours and theirs and ours["clients"].get("output_tok_s") and \
            theirs["clients"].get("output_tok_s"):
        ratio = ours["clients"]["output_tok_s"] / theirs["clients"]["output_tok_s"]
        goals.append(f"{args.clients}-client output tok/s = {ratio:.2f}x llama-server's")
    if goals:
        lines += ["", "Issue 42: " + "; ".join(goals) + "."]
    for r in results:
        s = r.summary
        notes = []
        if r.error:
            notes.append(f"failed: {r.error}")
        if s["failed"]:
            notes.append(f"{s['failed']} requests failed: {'; '.join(s['errors'])}")
        if s["wrong_output_len"]:
            notes.append(f"{s['wrong_output_len']} requests did not produce exactly "
                         f"{args.max_tokens} tokens (tok/s counts usage.completion_tokens)")
        if notes:
            lines.append(f"\n{LABELS[r.name]}: " + "; ".join(notes))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def image_size(text: str) -> tuple[int, int]:
    width, _, height = text.lower().partition("x")
    return int(width), int(height)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=None,
                        help="default: pagedserve, and llama-server where it is built")
    parser.add_argument("--model-dir", type=Path, default=vlm_model.DEFAULT_MODEL_DIR,
                        help="the Idefics3 checkpoint (built there if missing)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="pagedserve's --dtype")
    parser.add_argument("--gguf-outtype", default="f16", choices=["f16", "bf16", "f32"],
                        help="llama-server's weights (convert_hf_to_gguf.py --outtype)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="cold requests (each followed by its cached re-send)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=image_size, default=(640, 480),
                        help="WIDTHxHEIGHT of every image (default 640x480)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="llama-server's -t (pagedserve uses every allowed CPU)")
    parser.add_argument("--port", type=int, default=18320)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--result-dir", default="results/vision")
    parser.add_argument("--llama-server-bin", type=Path, default=DEFAULT_LLAMA_SERVER_BIN)
    parser.add_argument("--llama-cpp-tree", type=Path, default=vlm_model.LLAMA_CPP_TREE,
                        help="llama.cpp's source tree (convert_hf_to_gguf.py)")
    parser.add_argument("--pagedserve-args", type=shlex.split, default=[],
                        help="extra flags for `pagedserve serve`, one quoted string")
    parser.add_argument("--llamacpp-args", type=shlex.split, default=[],
                        help="extra flags for `llama-server`, one quoted string")
    args = parser.parse_args(argv)

    have_llamacpp = args.llama_server_bin.is_file()
    servers = args.servers or ["pagedserve"] + (["llamacpp"] if have_llamacpp else [])
    if "llamacpp" in servers and not have_llamacpp:
        parser.error(f"{args.llama_server_bin} is missing: run benchmarks/peers/setup_llamacpp.sh")
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)

    model_dir = vlm_model.ensure_checkpoint(args.model_dir)
    gguf = (vlm_model.convert_to_gguf(model_dir, outtype=args.gguf_outtype,
                                      tree=args.llama_cpp_tree)
            if "llamacpp" in servers else None)
    width, height = args.image_size
    seeds = [WARMUP_SEED, *(COLD_SEED + i for i in range(args.repeats)),
             *(CLIENTS_SEED + i for i in range(args.clients * args.requests_per_client))]
    urls = {seed: image_data_url(seed, width, height) for seed in seeds}
    image_tokens = image_token_count(model_dir, width, height)
    print(f"servers: {', '.join(servers)}; {len(urls)} images of {width}x{height} "
          f"({image_tokens} image tokens each)", flush=True)

    results = [run_server(args, name, model_dir, gguf, urls) for name in servers]
    table = markdown_table(args, results, image_tokens)
    print("\n" + table)
    out = Path(args.result_dir)
    (out / "table.md").write_text(table + "\n")
    payload = {
        "date": datetime.now(timezone.utc).isoformat(), "commit": commit(),
        "machine": machine_description(), "cpu_flags": cpu_flags(),
        "model": {"dir": str(model_dir), "shape": vlm_model.shape_summary(),
                  "gguf": [str(p) for p in gguf] if gguf else None},
        "workload": {"image_size": [width, height], "image_tokens": image_tokens,
                     "question": QUESTION, "max_tokens": args.max_tokens,
                     "repeats": args.repeats, "clients": args.clients,
                     "requests_per_client": args.requests_per_client},
        "servers": [{**asdict(r), "records": [asdict(rec) for rec in r.records]}
                    for r in results],
    }
    (out / "vision.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nwrote {out / 'table.md'} and {out / 'vision.json'}")
    failed = any(r.error or r.summary["failed"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
