"""benchmarks/embeddings.py end to end on a few sentences: both sides run, the vectors
agree, the JSON holds the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.embeddings import make_sentences

REPO = Path(__file__).resolve().parents[2]


def test_sentences_are_seeded_and_of_mixed_length():
    sentences = make_sentences(50)
    assert sentences == make_sentences(50)
    lengths = [len(s.split()) for s in sentences]
    assert min(lengths) >= 4 and max(lengths) <= 120 and len(set(lengths)) > 10


@pytest.mark.extended  # 25 s of model loading; PAGEDSERVE_EXTENDED_TESTS=1 runs it
def test_a_short_run_reports_both_sides(tmp_path):
    pytest.importorskip("all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "benchmarks.embeddings", "--num-sentences", "6",
                    "--batch-sizes", "1", "4", "--repeats", "1", "--json", str(out)],
                   cwd=REPO, check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())
    assert [row["batch"] for row in rows] == [1, 4]
    for row in rows:
        assert row["pagedserve_inputs_per_s"] > 0 and row["sentence_transformers_inputs_per_s"] > 0
        assert row["min_cosine"] >= 0.9999
