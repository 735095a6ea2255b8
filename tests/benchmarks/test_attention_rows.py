"""benchmarks/attention_rows.py on a tiny setting: it times every (keys, rows) asked for."""

from __future__ import annotations

import pytest

from benchmarks.attention_rows import main
from pagedserve_kernels.cpu_kernels import cpu_kernels


@pytest.mark.skipif(cpu_kernels() is None, reason="the C++ CPU kernels are not built here")
def test_attention_rows_times_each_cell():
    results = main(["--rows", "1", "3", "--keys", "20", "40", "--calls", "2", "--repeats", "1",
                    "--cache-dtype", "bfloat16"])
    assert sorted(results) == [(20, 1), (20, 3), (40, 1), (40, 3)]
    assert all(ms > 0 for ms in results.values())
    with pytest.raises(SystemExit):
        main(["--rows", "8", "--keys", "4"])  # a row would see more keys than exist
