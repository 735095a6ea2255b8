"""gpu_check.json: one record of a benchmarks/gpu_check.sh run, from what its steps left.

    python -m benchmarks.gpu_check_summary OUT_DIR [--dry-run]

Reads OUT_DIR/steps.tsv (name, exit status, seconds per step), OUT_DIR/junit-*.xml
(pytest's counts) and OUT_DIR/bench.json (benchmarks.gpu_bench); writes
OUT_DIR/gpu_check.json. Exit status 0 only if every step exited 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepResult:
    name: str
    returncode: int  # 124: stopped at its time limit
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def read_steps(path: Path) -> list[StepResult]:
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, returncode, seconds = line.split("\t")
        steps.append(StepResult(name, int(returncode), float(seconds)))
    return steps


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped of a pytest --junitxml file (all suites)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {key: sum(int(suite.get(key, 0)) for suite in suites) for key in keys}


def summarize(out_dir: Path, dry_run: bool) -> dict:
    steps = read_steps(out_dir / "steps.tsv")
    tests = {path.name: junit_counts(path) for path in sorted(out_dir.glob("junit-*.xml"))}
    bench_path = out_dir / "bench.json"
    bench = json.loads(bench_path.read_text()) if bench_path.exists() else None
    return dict(
        dry_run=dry_run,
        ok=bool(steps) and all(step.ok for step in steps),
        steps=[asdict(step) | {"ok": step.ok} for step in steps],
        tests=tests,
        bench=bench,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    summary = summarize(args.out_dir, args.dry_run)
    (args.out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    for step in summary["steps"]:
        print(f"  {'ok  ' if step['ok'] else 'FAIL'} {step['name']:<16} rc={step['returncode']:<4}"
              f"{step['seconds']:7.1f} s")
    for name, counts in summary["tests"].items():
        print(f"  {name}: {counts}")
    print(f"gpu check{' (dry run)' if args.dry_run else ''}: "
          f"{'OK' if summary['ok'] else 'FAILED'} -> {args.out_dir / 'gpu_check.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
