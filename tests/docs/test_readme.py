"""The README stays a user's page: short, no lab notebook, links that resolve.

History, long API notes and kernel notes belong in docs/; these checks keep them there.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 350
# A git commit hash as notes cite them: 7-40 hex digits with at least one letter and one
# digit (so "2048" or "deadbeef"-free words do not count), standing alone.
COMMIT_HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def prose_and_code(text: str) -> tuple[list[str], list[str]]:
    """The README's lines outside and inside ``` fences."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: "## Other APIs: A, B" -> "other-apis-a-b"."""
    text = heading.lstrip("#").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_readme_is_at_most_350_lines():
    assert len(readme_text().splitlines()) <= MAX_LINES


def test_readme_cites_no_commit_hashes():
    prose, _ = prose_and_code(readme_text())
    hits = [(line, COMMIT_HASH.findall(line)) for line in prose if COMMIT_HASH.search(line)]
    assert not hits, f"dated notes with commit hashes belong in docs/performance.md: {hits}"


def test_the_hash_check_would_catch_one():
    assert COMMIT_HASH.findall("at commit 9bc8a07 (and f97e76e)") == ["9bc8a07", "f97e76e"]
    assert not COMMIT_HASH.findall("2048 tokens, a deadbeef, 16 KiB, Q4_K_M, sha256")


def test_readme_has_one_results_table():
    text = readme_text()
    sections = re.split(r"^## ", text, flags=re.M)
    results = [s for s in sections if s.startswith("Results")]
    assert len(results) == 1, "one Results section"
    tables = [s for s in sections if re.search(r"^\|.*\|\n\|[-| :]+\|$", s, flags=re.M)]
    headers = re.findall(r"^\|.*\|\n\|[-| :]+\|$", results[0], flags=re.M)
    assert len(headers) == 1, "the Results section holds exactly one table"
    measured = [s.split("\n", 1)[0] for s in tables
                if re.search(r"tok/s|ITL|\bms\b", s) and not s.startswith("Results")]
    assert not measured, f"measured tables outside Results belong in docs/: {measured}"


def test_readme_links_resolve():
    text = readme_text()
    prose, _ = prose_and_code(text)
    anchors = {anchor(line) for line in text.splitlines() if line.startswith("#")}
    broken = []
    for target in LINK.findall("\n".join(prose)):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, fragment = target.partition("#")
        if not path:
            if fragment not in anchors:
                broken.append(target)
            continue
        file = ROOT / path
        if not file.exists():
            broken.append(target)
        elif fragment and file.suffix == ".md":
            headings = {anchor(line) for line in file.read_text(encoding="utf-8").splitlines()
                        if line.startswith("#")}
            if fragment not in headings:
                broken.append(target)
    assert not broken, f"links that lead nowhere: {broken}"
