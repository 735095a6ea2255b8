"""Serving-benchmark helpers: run benchmarks/serve.py's client against a URL.

Shared by tests/benchmarks/test_bench_serve.py and tests/server/test_server_model.py.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from benchmarks import serve


def bench_args(base_url: str, *extra: str) -> argparse.Namespace:
    """Parsed benchmark options for ``base_url`` (no progress bar), plus ``extra`` CLI args."""
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(["--base-url", base_url, "--disable-tqdm", *extra])


def run_bench(base_url: str, *extra: str) -> Any:
    """Run the benchmark against any OpenAI-compatible server and return its metrics."""
    return asyncio.run(serve.run_benchmark(bench_args(base_url, *extra)))
