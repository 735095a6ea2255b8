"""Two replicas behind the routers people run in front of vLLM, one run, same workload.

    python -m benchmarks.routers                      # default model, every installed router
    python -m benchmarks.routers --tenants 6 --requests-per-tenant 6 --concurrency 4

The workload (issue 43): `--tenants` tenants, each with its own long system prompt (about
`--system-tokens` tokens), send `--requests-per-tenant` chats each (a short question,
`--max-tokens` tokens back), all of them in one shuffled order, `--concurrency` at a time.
A router that keeps a tenant on the replica that already holds its system prompt's KV
turns most of the prefill into prefix-cache hits; round robin computes each system prompt
once on every replica.

Runs, each on two fresh replicas (empty caches; each pinned to its own core with
`--cpu-threads 1` where the machine has two or more): vllm-router (PyPI `vllm-router`)
with round_robin, cache_aware and kv_aware (fed by the replicas' KV events,
`--kv-events-config`), and smg (PyPI `smg`) with round_robin and cache_aware; a router
that is not installed is skipped; and `direct`: one replica on every core, no router.
Reported per run: wall time, the prefix-cache hit rate
(cached prompt tokens / prompt tokens, from each response's `usage`), its ideal (every
request but each tenant's first hits the whole system prompt, in whole blocks), errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

import httpx

from benchmarks.compare_servers import (
    commit,
    cpu_flags,
    machine_description,
    stop,
    wait_until_ready,
)

RUNS = (("vllm-router", "round_robin"), ("vllm-router", "cache_aware"),
        ("vllm-router", "kv_aware"), ("smg", "round_robin"), ("smg", "cache_aware"),
        ("direct", "one replica"))
# "direct": the same workload sent to ONE replica on every core (no router, no pinning):
# whether two replicas behind a router beat one engine on this machine's cores.
MODEL = "default"


@dataclass
class Replica:
    url: str
    process: subprocess.Popen
    events_endpoint: str
    replay_endpoint: str


@dataclass
class RunResult:
    router: str
    policy: str
    wall_s: float
    prompt_tokens: int
    cached_tokens: int
    errors: int
    per_replica: list[int]  # requests each replica served

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(self.prompt_tokens, 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str | None:
    return shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)


@contextlib.contextmanager
def replicas(args: argparse.Namespace, count: int = 2) -> Iterator[list[Replica]]:
    started: list[Replica] = []
    pin = (count > 1 and shutil.which("taskset") is not None
           and len(os.sched_getaffinity(0)) >= count)
    try:
        for index in range(count):
            port = free_port()
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://127.0.0.1:{free_port()}",
                      "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
            command = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1",
                       "--port", str(port), "--served-model-name", MODEL,
                       "--block-size", str(args.block_size), "--max-model-len", "4096",
                       "--kv-events-config", json.dumps(events), "--log-level", "warning"]
            if pin:
                command = ["taskset", "-c", str(index), *command, "--cpu-threads", "1"]
            process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
            started.append(Replica(f"http://127.0.0.1:{port}", process, events["endpoint"],
                                   events["replay_endpoint"]))
        for replica in started:
            wait_until_ready(replica.url, replica.process, 300)
        yield started
    finally:
        for replica in started:
            stop(replica.process)


@contextlib.contextmanager
def router(name: str, policy: str, pool: list[Replica], block_size: int) -> Iterator[str]:
    port = free_port()
    urls = [r.url for r in pool]
    command = [binary(name), "launch"] if name == "smg" else [binary(name)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--prometheus-port", str(free_port()), "--worker-urls", *urls]
    if policy == "kv_aware":
        command += ["--kv-event-block-size", str(block_size), "--kv-event-model", MODEL]
        for r in pool:
            command += ["--kv-event-source", f"{r.url}={r.events_endpoint}",
                        "--kv-event-replay-source", f"{r.url}={r.replay_endpoint}"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, process, 300)
        yield url
    finally:
        stop(process)


def system_prompt(tenant: int, num_words: int) -> str:
    words = random.Random(tenant).choices(
        ["policy", "invoice", "customer", "refund", "shipping", "account", "support",
         "order", "warranty", "return", "billing", "delivery", "contract", "service"],
        k=num_words)
    return f"You are the assistant of tenant {tenant}. " + " ".join(words) + "."


def workload(args: argparse.Namespace) -> list[tuple[int, list[dict]]]:
    """(tenant, messages) per request, shuffled."""
    requests = [(t, [{"role": "system", "content": system_prompt(t, args.system_tokens)},
                     {"role": "user", "content": f"Question {q} of tenant {t}?"}])
                for t in range(args.tenants) for q in range(args.requests_per_tenant)]
    random.Random(args.seed).shuffle(requests)
    return requests


def ideal_hit_rate(args: argparse.Namespace, replica: Replica,
                   requests: list[tuple[int, list[dict]]]) -> float:
    """Each tenant's first request misses; every later one hits its system prompt's
    whole blocks (the tokens every request of the tenant shares)."""
    def tokens(messages: list[dict]) -> list[int]:
        body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
        return httpx.post(replica.url + "/tokenize", json=body, timeout=60).json()["tokens"]

    total = hits = 0
    seen: dict[int, list[int]] = {}
    for tenant, messages in requests:
        ids = tokens(messages)
        total += len(ids)
        if tenant in seen:
            shared = next((i for i, (a, b) in enumerate(zip(ids, seen[tenant], strict=False))
                           if a != b), min(len(ids), len(seen[tenant])))
            hits += shared // args.block_size * args.block_size
        else:
            seen[tenant] = ids
    return hits / total


def served_count(replica: Replica) -> int:
    text = httpx.get(replica.url + "/metrics", timeout=10).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pagedserve:request_success_total")))


def run(args: argparse.Namespace, name: str, policy: str, pool: list[Replica],
        requests: list[tuple[int, list[dict]]]) -> RunResult:
    before = [served_count(r) for r in pool]
    front = (contextlib.nullcontext(pool[0].url) if name == "direct"
             else router(name, policy, pool, args.block_size))
    # One client for all requests (its connections kept): a client per request would
    # spend ~20 ms of CPU each on a new TLS context, on the cores the replicas run on.
    with front as url, httpx.Client(timeout=600, limits=httpx.Limits(
            max_connections=args.concurrency)) as client:
        def send(messages: list[dict]) -> dict | None:
            response = client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": args.max_tokens,
                "temperature": 0})
            return response.json()["usage"] if response.status_code == 200 else None

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as executor:
            usages = list(executor.map(send, [m for _, m in requests]))
        wall = time.perf_counter() - start
    done = [u for u in usages if u is not None]
    return RunResult(
        name, policy, wall, sum(u["prompt_tokens"] for u in done),
        sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in done),
        len(usages) - len(done), [served_count(r) - b for r, b in zip(pool, before, strict=True)])


def markdown(args: argparse.Namespace, results: list[RunResult], ideal: float) -> str:
    baseline = next((r.wall_s for r in results if r.policy == "round_robin"), None)
    lines = [f"{datetime.now(timezone.utc):%Y-%m-%d}, {machine_description()}, "
             f"flags: {cpu_flags()}, commit {commit()}; {args.tenants} tenants x "
             f"{args.requests_per_tenant} requests, ~{args.system_tokens}-word system "
             f"prompts, {args.concurrency} at a time, 2 replicas of the default model",
             "", "| router | policy | wall s | vs round robin | hit rate | ideal | errors | "
             "requests per replica |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r.wall_s / baseline:.2f}x" if baseline else "—"
        lines.append(f"| {r.router} | {r.policy} | {r.wall_s:.1f} | {ratio} | "
                     f"{r.hit_rate:.3f} | {ideal:.3f} | {r.errors} | {r.per_replica} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--requests-per-tenant", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=900,
                        help="words in each tenant's system prompt (about a token each)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--routers", nargs="+", default=sorted({n for n, _ in RUNS}),
                        help="which runs (direct: one replica on every core, no router)")
    parser.add_argument("--json", help="write the results here as JSON")
    args = parser.parse_args(argv)
    requests = workload(args)
    results: list[RunResult] = []
    ideal = None
    for name, policy in RUNS:
        if name not in args.routers or (name != "direct" and binary(name) is None):
            print(f"skipped {name} {policy}: not installed or not asked for", file=sys.stderr)
            continue
        with replicas(args, 1 if name == "direct" else 2) as pool:
            if ideal is None:
                ideal = ideal_hit_rate(args, pool[0], requests)
            results.append(run(args, name, policy, pool, requests))
            print(results[-1], file=sys.stderr)
    print(markdown(args, results, ideal or 0.0))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ideal": ideal, "runs": [r.__dict__ for r in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
