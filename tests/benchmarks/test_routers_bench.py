"""benchmarks/routers.py's workload and report (the runs themselves need the routers'
binaries and minutes: run the benchmark)."""

from __future__ import annotations

import argparse

from benchmarks.routers import RunResult, markdown, workload


def args(**overrides) -> argparse.Namespace:
    values = dict(tenants=3, requests_per_tenant=4, system_tokens=50, concurrency=2, seed=0)
    return argparse.Namespace(**{**values, **overrides})


def test_each_tenant_shares_one_system_prompt_and_the_order_is_shuffled():
    requests = workload(args())
    assert len(requests) == 12
    systems = {t: {m[0]["content"] for tt, m in requests if tt == t} for t in range(3)}
    assert all(len(s) == 1 for s in systems.values())
    assert len({s.pop() for s in systems.values()}) == 3
    assert len({m[1]["content"] for _, m in requests}) == 12
    assert [t for t, _ in requests] != sorted(t for t, _ in requests)
    assert workload(args()) == requests  # the seed fixes the order


def test_the_report_compares_with_round_robin():
    results = [RunResult("vllm-router", "round_robin", 20.0, 1000, 600, 0, [6, 6]),
               RunResult("vllm-router", "cache_aware", 10.0, 1000, 800, 1, [8, 3])]
    table = markdown(args(), results, 0.81)
    assert "| vllm-router | cache_aware | 10.0 | 0.50x | 0.800 | 0.810 | 1 | [8, 3] |" in table
