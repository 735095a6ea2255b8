"""The CPU-side tools of benchmarks/gpu_check.sh: the wheel checks and the summary.

(The script's whole dry run, `make gpu-check ARGS=--dry-run`, takes minutes; these
check the parts that decide, on made-up wheels and step records.)
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_check_deps, gpu_check_summary


def make_wheel(directory: Path, name: str, version: str, requires: list[str]) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    lines = [f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


@pytest.fixture
def lists(tmp_path, monkeypatch):
    manifest, image = tmp_path / "wheels.txt", tmp_path / "image.txt"
    manifest.write_text("alpha==1.0  # ours\nbeta==2.0\n")
    image.write_text("# the image\nnumpy==2.5.2\nrequests\n")
    monkeypatch.setattr(gpu_check_deps, "MANIFEST", manifest)
    monkeypatch.setattr(gpu_check_deps, "PREINSTALLED", image)
    wheels = tmp_path / "whl"
    wheels.mkdir()
    return wheels


def test_complete_wheels_pass(lists):
    make_wheel(lists, "alpha", "1.0", ["beta>=2", "numpy>=2", "requests",
                                       "cffi; implementation_name == 'pypy'",
                                       "rich; extra == 'cli'"])
    make_wheel(lists, "beta", "2.0", ["typing-extensions>=4; python_version < '3.11'"])
    assert gpu_check_deps.check_wheels(lists) == []


def test_incomplete_wheels_are_named(lists):
    make_wheel(lists, "alpha", "1.0", ["numpy>=3", "opentelemetry-api>=1.44"])
    make_wheel(lists, "gamma", "0.1", [])
    problems = gpu_check_deps.check_wheels(lists)
    assert any("needs numpy>=3, finds numpy==2.5.2" in p for p in problems)
    assert any("opentelemetry-api>=1.44: neither carried nor there" in p for p in problems)
    assert any("beta==2.0 has no wheel" in p for p in problems)
    assert any("gamma-0.1-py3-none-any.whl is not in" in p for p in problems)


def test_imports_of_ours_must_be_provided(lists, tmp_path):
    record = tmp_path / "step.json"
    record.write_text(json.dumps({
        "alpha": {"importer": "engine", "distributions": ["alpha"]},  # carried
        "numpy": {"importer": "__main__", "distributions": ["numpy"]},  # the image's
        "trio": {"importer": "httpcore", "distributions": ["trio"]},  # the image's business
        "msgspec": {"importer": "engine", "distributions": ["msgspec"]},  # missing
    }))
    problems = gpu_check_deps.check_imports([record])
    assert problems == ["step.json: engine imports msgspec (msgspec): neither carried nor there"]


def test_summary_reads_steps_junit_and_bench(tmp_path):
    (tmp_path / "steps.tsv").write_text("env\t0\t1.5\nparity\t124\t210.0\n")
    (tmp_path / "junit-parity.xml").write_text(
        '<testsuites><testsuite tests="32" failures="1" errors="0" skipped="16"/></testsuites>')
    (tmp_path / "bench.json").write_text(json.dumps({"results": []}))
    assert gpu_check_summary.main([str(tmp_path)]) == 1  # parity hit its time limit
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["ok"] for s in summary["steps"]] == [True, False]
    assert summary["tests"]["junit-parity.xml"] == dict(tests=32, failures=1, errors=0,
                                                         skipped=16)
    assert summary["bench"] == {"results": []} and not summary["ok"]
