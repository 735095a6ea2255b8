"""benchmarks/compare_servers.py: the parts that need no server (commands, table)."""

from __future__ import annotations

import argparse
import json

from benchmarks import compare_servers
from benchmarks import serve as bench_serve


def test_both_servers_get_the_same_workload_and_transformers_keeps_going_past_eos():
    args = argparse.Namespace(input_len=128, output_len=64, seed=3)
    ours = compare_servers.bench_args(args, "pagedserve", "http://127.0.0.1:1", "/m", 8,
                                      "r.json", num_prompts=16, num_warmups=0)
    theirs = compare_servers.bench_args(args, "transformers", "http://127.0.0.1:2", "/m", 8,
                                        "r.json", num_prompts=16, num_warmups=0)
    for argv in (ours, theirs):  # both parse as benchmarks.serve arguments
        parser = argparse.ArgumentParser()
        bench_serve.add_cli_args(parser)
        parsed = parser.parse_args(argv)
        assert (parsed.endpoint, parsed.num_prompts, parsed.max_concurrency) == ("chat", 16, 8)
        assert (parsed.random_input_len, parsed.random_output_len, parsed.seed) == (128, 64, 3)
    assert "--no-ignore-eos" not in ours
    extra = json.loads(theirs[theirs.index("--extra-body") + 1])
    assert json.loads(extra["generation_config"]) == {"eos_token_id": -1}
    command = compare_servers.server_command("transformers", "/m", "float32", 2, [])
    assert command[1:4] == ["serve", "/m", "--continuous-batching"]
    assert "127.0.0.1" in command and "127.0.0.1" in compare_servers.server_command(
        "pagedserve", "/m", "float32", 1, [])


def test_table_has_a_row_per_level_and_the_throughput_ratio():
    def metrics(tok_s: float, ttft: float) -> dict:
        stats = {"mean": ttft, "median": ttft, "p90": ttft, "p99": 2 * ttft, "count": 4}
        return {"completed": 4, "failed": 0, "output_throughput": tok_s, "ttft_ms": stats,
                "itl_ms": stats, "tpot_ms": stats, "e2el_ms": stats}

    args = argparse.Namespace(input_len=128, output_len=128, dtype="float32",
                                              prompts_per_client=2, concurrency=[1, 32])
    results = [
        compare_servers.LevelResult("pagedserve", 1, metrics(10.0, 500)),
        compare_servers.LevelResult("pagedserve", 32, metrics(90.0, 5000)),
        compare_servers.LevelResult("transformers", 1, metrics(12.5, 400)),
        compare_servers.LevelResult("transformers", 32, metrics(30.0, 9000)),
    ]
    table = compare_servers.markdown_table(args, results)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "clients" not in line]
    assert len(rows) == 4
    assert "| pagedserve | 32 | 4 / 0 | 90.0 | 5,000 | 10,000 |" in table
    assert "1 clients: pagedserve / transformers output tok/s = 0.80x" in table
    assert "32 clients: pagedserve / transformers output tok/s = 3.00x" in table
