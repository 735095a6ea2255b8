"""benchmarks/vision.py: its images are fixed by their seed and differ from each other, and
its summary and table compute the issue's ratios from the requests' records."""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.vision import Record, ServerResult, markdown_table, summarize, synthetic_photo


def test_images_are_seeded_and_distinct():
    first, again, other = (np.asarray(synthetic_photo(seed, 64, 48)) for seed in (1, 1, 2))
    assert first.shape == (48, 64, 3)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)


def args(**overrides) -> argparse.Namespace:
    values = dict(max_tokens=4, clients=2, requests_per_client=1, repeats=2,
                  image_size=(640, 480), model_dir="m")
    values.update(overrides)
    return argparse.Namespace(**values)


def result(name: str, cold_ms: list[float], cached_ms: list[float], tokens: int = 4,
           wall_s: float = 2.0) -> ServerResult:
    records = [Record("cold", i, i, ok=True, ttft_ms=t, e2e_ms=t + 10, prompt_tokens=900,
                      completion_tokens=tokens) for i, t in enumerate(cold_ms)]
    records += [Record("cached", i, i, ok=True, ttft_ms=t, e2e_ms=t + 10, prompt_tokens=900,
                       cached_tokens=896, completion_tokens=tokens)
                for i, t in enumerate(cached_ms)]
    records += [Record("clients", i, 100 + i, ok=True, ttft_ms=50.0, e2e_ms=90.0,
                       prompt_tokens=900, completion_tokens=tokens) for i in range(2)]
    records.append(Record("clients", 2, 102, ok=False, error="HTTP 500"))
    out = ServerResult(name, ["x"], "w", records, clients_wall_s=wall_s)
    out.summary = summarize(args(), out)
    return out


def test_summary_and_table_give_the_goal_ratios():
    ours = result("pagedserve", [1000.0, 3000.0], [100.0, 300.0])
    theirs = result("llamacpp", [4000.0, 4000.0], [50.0, 50.0], tokens=3, wall_s=4.0)
    assert ours.summary["cold"]["ttft_ms_p50"] == 2000.0
    assert ours.summary["cached_over_cold"] == 0.1
    assert ours.summary["clients"]["output_tok_s"] == 8 / 2.0
    assert ours.summary["failed"] == 1 and ours.summary["errors"] == ["HTTP 500"]
    assert theirs.summary["wrong_output_len"] == 6  # 3 tokens where 4 were asked
    table = markdown_table(args(), [ours, theirs], image_tokens=832)
    assert "cold TTFT = 0.50x llama-server's" in table
    assert "cached TTFT = 0.10x its cold" in table
    assert "2-client output tok/s = 2.67x llama-server's" in table
    assert "900 (896 cached on the re-send)" in table
