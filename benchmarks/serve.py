"""Online serving benchmark for any OpenAI-compatible server.

Sends streaming ``/v1/completions`` or ``/v1/chat/completions`` requests on a
chosen arrival schedule, records per-request timestamps, and reports
throughput, TTFT, TPOT, ITL, end-to-end latency, goodput and peak concurrency.

Run it as ``python -m benchmarks.serve --help`` or ``pagedserve bench serve --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import httpx
import numpy as np

from benchmarks.datasets import (
    SampleRequest,
    build_dataset,
    count_tokens,
    load_tokenizer,
    summarize,
)
from benchmarks.metrics import (
    BenchmarkMetrics,
    RequestResult,
    compute_metrics,
    format_table,
    parse_goodput,
)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DEFAULT_NUM_PROMPTS = 100


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark's options to ``parser`` (also used by ``pagedserve bench serve``)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="Server root URL (a trailing /v1 is accepted). Default: %(default)s",
    )
    g.add_argument(
        "--endpoint",
        choices=sorted(ENDPOINT_PATHS),
        default="completions",
        help="Which OpenAI API to call. Default: %(default)s",
    )
    g.add_argument(
        "--model",
        default=None,
        help="Model name sent in requests. Default: the first id from GET /v1/models.",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapter names the server serves (its --lora-modules): request i names "
        "adapter i mod N (an even spread; vLLM's bench picks one at random), warm-ups too. "
        "Overrides --model.",
    )
    g.add_argument(
        "--api-key", default=None, help="Bearer token. Default: $OPENAI_API_KEY if set, else none."
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=3600.0,
        help="Per-request connect/read timeout in seconds. Default: %(default)s",
    )
    g.add_argument(
        "--no-keepalive",
        action="store_true",
        help="A new connection for every request (a server that drops idle keep-alive "
        "connections, as llama-server does after 5 s, then fails no request).",
    )
    g.add_argument(
        "--wait-for-server",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="Poll GET /v1/models for up to this long before starting. Default: 0",
    )

    g = parser.add_argument_group("dataset")
    g.add_argument(
        "--dataset",
        choices=("random", "prefix", "jsonl"),
        default="random",
        help="Prompt source. Default: %(default)s",
    )
    g.add_argument("--dataset-path", default=None, help="JSON-lines file for --dataset jsonl.")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory, a .gguf file, or a hub id. Default: --model if it "
        "is a local path. Needed by the random and prefix datasets and to count "
        "output tokens when the server reports no usage.",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Allow custom tokenizer code when loading --tokenizer.",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"Number of requests. Default: {DEFAULT_NUM_PROMPTS} (jsonl: every line of the file).",
    )
    g.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="Mean prompt length in tokens (random). Default: %(default)s",
    )
    g.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="Mean max_tokens (random). Default: %(default)s",
    )
    g.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths are drawn uniformly from [len*(1-r), len*(1+r)]. Default: 0",
    )
    g.add_argument(
        "--prefix-num-prefixes",
        type=int,
        default=4,
        help="Distinct shared prefixes (prefix). Default: %(default)s",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=512,
        help="Shared prefix length in tokens (prefix). Default: %(default)s",
    )
    g.add_argument(
        "--prefix-suffix-len",
        type=int,
        default=32,
        help="Unique suffix length in tokens (prefix). Default: %(default)s",
    )
    g.add_argument(
        "--prefix-output-len",
        type=int,
        default=64,
        help="max_tokens per request (prefix). Default: %(default)s",
    )
    g.add_argument(
        "--jsonl-output-len",
        type=int,
        default=128,
        help="max_tokens for jsonl lines that give none. Default: %(default)s",
    )

    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Mean arrivals per second; 'inf' sends everything at once. Default: inf",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="Gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, "
        ">1 more regular. Default: %(default)s",
    )
    g.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="Cap on requests in flight (extra arrivals wait client-side; their TTFT "
        "is measured from when they are actually sent). Default: no cap",
    )
    g.add_argument("--seed", type=int, default=0, help="Seed for datasets and arrivals.")
    g.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        help="Requests sent one by one before timing starts (not counted). Default: 0",
    )

    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="Default: %(default)s (greedy)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None, help="Non-standard field; sent only if set.")
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="Do not send 'ignore_eos: true' (for servers that reject the field).",
    )
    g.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="JSON object merged into every request body (last, so it can override).",
    )

    g = parser.add_argument_group("report")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds).",
    )
    g.add_argument("--result-file", default=None, help="Write the results as JSON here.")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="Include per-request timings and errors in the result file.",
    )
    g.add_argument("--label", default=None, help="Free-form label stored with the results.")
    g.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    return parser


def validate_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` for option values the benchmark cannot run with."""
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (use inf to send everything at once)")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError("--burstiness must be a positive number")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if args.num_warmups < 0:
        raise ValueError("--num-warmups must be >= 0")
    if args.extra_body is not None:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    parse_goodput(args.goodput)


# ---------------------------------------------------------------------------
# Arrivals
# ---------------------------------------------------------------------------


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send offsets in seconds from the benchmark start, one per request, non-decreasing.

    The first request goes at 0. The gaps between successive requests are
    gamma-distributed with shape ``burstiness`` and mean ``1 / request_rate``
    (``burstiness == 1`` is a Poisson process). An infinite rate sends
    everything at 0.
    """
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if not request_rate > 0:
        raise ValueError("request_rate must be > 0")
    if not burstiness > 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(request_rate) or num_requests == 0:
        return np.zeros(num_requests)
    rng = np.random.default_rng([seed, 0x5EED])
    gaps = rng.gamma(
        shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1
    )
    return np.concatenate([[0.0], np.cumsum(gaps)])


# ---------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------


def api_root(base_url: str) -> str:
    """``base_url`` without a trailing slash or ``/v1``."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root


def build_payload(
    endpoint: str,
    model: str,
    sample: SampleRequest,
    *,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int | None = None,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streaming request."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "completions":
        body["prompt"] = sample.prompt
    elif endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    body["max_tokens"] = sample.max_tokens
    body["temperature"] = temperature
    if top_p is not None:
        body["top_p"] = top_p
    if top_k is not None:
        body["top_k"] = top_k
    if ignore_eos:
        body["ignore_eos"] = True
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    if extra_body:
        body.update(extra_body)
    return body


def parse_chunk(obj: Any, endpoint: str) -> tuple[str, dict[str, Any] | None]:
    """Generated text and usage (if any) carried by one decoded SSE ``data:`` object.

    Raises ``RuntimeError`` if the chunk reports an error.
    """
    if not isinstance(obj, dict):
        raise RuntimeError(f"unexpected stream chunk: {obj!r}")
    if obj.get("error"):
        err = obj["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        raise RuntimeError(f"server error in stream: {msg}")
    usage = obj.get("usage") or None
    text = ""
    choices = obj.get("choices") or []
    if choices:
        choice = choices[0]
        if endpoint == "chat":
            delta = choice.get("delta") or {}
            text = (delta.get("reasoning_content") or delta.get("reasoning") or "") + (
                delta.get("content") or ""
            )
        else:
            text = choice.get("text") or ""
    return text, usage


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    endpoint: str,
    headers: dict[str, str] | None = None,
) -> RequestResult:
    """Send one streaming request and record its timeline. Never raises for request errors."""
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace").strip()
                raise RuntimeError(f"HTTP {resp.status_code}: {body[:500]}")
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event:/id: fields
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    # Read on to the end of the body so the connection can be reused.
                    continue
                text, chunk_usage = parse_chunk(json.loads(data), endpoint)
                if chunk_usage:
                    usage = chunk_usage
                if text:
                    chunk_times.append(now)
                    pieces.append(text)
        end = time.perf_counter()
        if not chunk_times:
            raise RuntimeError("stream ended without any generated text")
    except Exception as e:  # every failure is recorded; none aborts the run
        return RequestResult(
            start_time=start,
            end_time=time.perf_counter(),
            first_token_time=chunk_times[0] if chunk_times else None,
            chunk_times=chunk_times,
            success=False,
            error=f"{type(e).__name__}: {e}",
            generated_text="".join(pieces),
        )
    result = RequestResult(
        start_time=start,
        end_time=end,
        first_token_time=chunk_times[0],
        chunk_times=chunk_times,
        success=True,
        generated_text="".join(pieces),
    )
    if usage:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens = int(usage.get("completion_tokens") or 0)
    return result


def fill_token_counts(
    results: Sequence[RequestResult], samples: Sequence[SampleRequest], tokenizer: Any | None
) -> Counter:
    """Fill in token counts the server did not report; returns how each output count was found.

    Prompt tokens fall back to the dataset's length; output tokens to the
    tokenizer's count of the generated text, or to the number of content
    chunks when there is no tokenizer.
    """
    sources: Counter = Counter()
    for result, sample in zip(results, samples, strict=True):
        if not result.success:
            continue
        if result.prompt_tokens <= 0:
            result.prompt_tokens = sample.prompt_len
        if result.output_tokens > 0:
            sources["server usage"] += 1
        elif tokenizer is not None:
            result.output_tokens = count_tokens(tokenizer, result.generated_text)
            sources["tokenizer"] += 1
        else:
            result.output_tokens = len(result.chunk_times)
            sources["chunk count"] += 1
    return sources


async def fetch_model_id(client: httpx.AsyncClient, root: str, headers: dict[str, str]) -> str:
    resp = await client.get(root + "/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models listed no models; pass --model")
    return str(data[0]["id"])


async def wait_for_server(
    client: httpx.AsyncClient, root: str, headers: dict[str, str], timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = await client.get(root + "/v1/models", headers=headers, timeout=5.0)
            if resp.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise RuntimeError(f"server at {root} not ready after {timeout:g}s")
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


# ---------------------------------------------------------------------------
# Benchmark
# ---------------------------------------------------------------------------


def _resolve_tokenizer_path(args: argparse.Namespace) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    if args.model and os.path.exists(os.path.expanduser(args.model)):
        return args.model
    return None


def _json_number(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


async def run_benchmark(args: argparse.Namespace) -> BenchmarkMetrics:
    """Run the benchmark described by ``args`` (from ``add_cli_args``) and report the results."""
    validate_args(args)
    log = functools.partial(print, flush=True)
    slos = parse_goodput(args.goodput)
    extra_body = json.loads(args.extra_body) if args.extra_body else None

    tok_path = _resolve_tokenizer_path(args)
    tokenizer = load_tokenizer(tok_path, args.trust_remote_code) if tok_path else None
    if args.num_prompts is None and args.dataset != "jsonl":
        args.num_prompts = DEFAULT_NUM_PROMPTS
    samples = build_dataset(args, tokenizer)
    log(f"Dataset {args.dataset}: {summarize(samples)}")
    offsets = arrival_times(len(samples), args.request_rate, args.burstiness, args.seed)

    root = api_root(args.base_url)
    url = root + ENDPOINT_PATHS[args.endpoint]
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conc = args.max_concurrency
    limits = httpx.Limits(max_connections=conc,
                          max_keepalive_connections=0 if args.no_keepalive else conc)
    # trust_env=False: never route benchmark traffic through a proxy from the environment.
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(args.request_timeout), limits=limits, trust_env=False
    ) as client:
        if args.wait_for_server > 0:
            await wait_for_server(client, root, headers, args.wait_for_server)
        model = args.model or await fetch_model_id(client, root, headers)
        # The model each request names: one, or adapter i mod N (--lora-modules).
        request_models = args.lora_modules or [model]

        def payload(sample: SampleRequest, index: int) -> dict[str, Any]:
            return build_payload(
                args.endpoint,
                request_models[index % len(request_models)],
                sample,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                ignore_eos=args.ignore_eos,
                extra_body=extra_body,
            )

        for i in range(args.num_warmups):
            warm = await send_request(
                client, url, payload(samples[i % len(samples)], i), args.endpoint, headers
            )
            if not warm.success:
                hint = ""
                if "ignore_eos" in warm.error:
                    hint = " (this server rejects ignore_eos: try --no-ignore-eos)"
                raise RuntimeError(f"warmup request failed: {warm.error}{hint}")
        if args.num_warmups:
            log(f"Warmup: {args.num_warmups} request(s) done")

        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        log(
            f"Sending {len(samples)} requests to {url} (model {model}), request rate {rate}, "
            f"burstiness {args.burstiness:g}, max concurrency {conc or 'unlimited'}"
        )
        pbar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(samples), desc="requests", unit="req")
        semaphore = asyncio.Semaphore(conc) if conc else None

        async def one(sample: SampleRequest, index: int) -> RequestResult:
            if semaphore is None:
                result = await send_request(client, url, payload(sample, index), args.endpoint,
                                            headers)
            else:
                async with semaphore:
                    result = await send_request(
                        client, url, payload(sample, index), args.endpoint, headers
                    )
            if pbar is not None:
                pbar.update(1)
            return result

        bench_start = time.perf_counter()
        tasks = []
        for index, (sample, offset) in enumerate(zip(samples, offsets.tolist(), strict=True)):
            delay = bench_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sample, index)))
        results: list[RequestResult] = list(await asyncio.gather(*tasks))
        bench_end = time.perf_counter()
        if pbar is not None:
            pbar.close()

    sources = fill_token_counts(results, samples, tokenizer)
    metrics = compute_metrics(results, bench_end - bench_start, slos)
    title = "Serving Benchmark Result" + (f" [{args.label}]" if args.label else "")
    log(format_table(metrics, title))
    if sources and set(sources) != {"server usage"}:
        log("Output tokens counted by: " + ", ".join(f"{k} ({v})" for k, v in sources.items()))
    errors = Counter(r.error for r in results if not r.success)
    if errors:
        log("Errors (most common first):")
        for err, n in errors.most_common(5):
            log(f"  {n} x {err[:300]}")

    if args.result_file:
        record: dict[str, Any] = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "label": args.label,
            "config": {
                "base_url": args.base_url,
                "endpoint": args.endpoint,
                "model": model,
                "lora_modules": args.lora_modules,
                "tokenizer": tok_path,
                "dataset": args.dataset,
                "dataset_path": args.dataset_path,
                "num_prompts": len(samples),
                "random_input_len": args.random_input_len,
                "random_output_len": args.random_output_len,
                "random_range_ratio": args.random_range_ratio,
                "prefix_num_prefixes": args.prefix_num_prefixes,
                "prefix_len": args.prefix_len,
                "prefix_suffix_len": args.prefix_suffix_len,
                "prefix_output_len": args.prefix_output_len,
                "request_rate": _json_number(args.request_rate),
                "burstiness": args.burstiness,
                "max_concurrency": conc,
                "seed": args.seed,
                "temperature": args.temperature,
                "ignore_eos": args.ignore_eos,
                "extra_body": extra_body,
            },
            "metrics": dataclasses.asdict(metrics),
            "output_token_sources": dict(sources),
            "errors": dict(errors.most_common(20)),
        }
        if args.save_detailed:
            record["requests"] = [
                {
                    "start_s": r.start_time - bench_start,
                    "end_s": r.end_time - bench_start,
                    "ttft_ms": None if r.ttft is None else r.ttft * 1000.0,
                    "chunk_times_s": [t - bench_start for t in r.chunk_times],
                    "prompt_tokens": r.prompt_tokens,
                    "output_tokens": r.output_tokens,
                    "generated_text": r.generated_text,
                    "success": r.success,
                    "error": r.error,
                }
                for r in results
            ]
        directory = os.path.dirname(os.path.abspath(args.result_file))
        os.makedirs(directory, exist_ok=True)
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
        log(f"Results written to {args.result_file}")
    return metrics


def run_cli(args: argparse.Namespace) -> int:
    """Run from parsed options; returns the exit status (1 if nothing completed or on error)."""
    try:
        metrics = asyncio.run(run_benchmark(args))
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0 if metrics.completed > 0 else 1


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks.serve") -> int:
    """Command-line entry point; ``prog`` names the command in ``--help`` and usage errors."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Benchmark an OpenAI-compatible server with streaming requests.",
    )
    add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except ValueError as e:
        parser.error(str(e))
    return run_cli(args)


if __name__ == "__main__":
    sys.exit(main())
