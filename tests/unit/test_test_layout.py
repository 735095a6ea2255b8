"""The layout of tests/ itself: test modules import helpers only from tests.support.

A test module that imports another test module runs (and, under pytest, collects) that
module's tests twice over, ties the two files' fixtures and module state together, and
breaks when the imported file moves. Shared helpers live in tests/support/, fixtures in
conftest.py files; tests/ root holds only conftest.py and __init__.py, every test sits in
a folder named for what it tests.

import-linter cannot say this (its module expressions take a wildcard only for a whole
module name, not for ``test_*``), so it is checked here by parsing every file's imports.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT_FILES_ALLOWED = {"__init__.py", "conftest.py"}
SUPPORT = "tests.support"


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    """tests/engine/test_models.py -> tests.engine.test_models (a package: its dotted path)."""
    parts = path.relative_to(TESTS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in `path`, at any depth (inside
    functions too); ``from X import name`` yields X.name as well as X, because `name`
    may be a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if node.module:
                found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if alias.name != "*"]
    return found


def bare_test_module_names() -> set[str]:
    """Bare names a test module or conftest could be imported by (rootdir-style sys.path)."""
    return {p.stem for p in python_files() if p.stem.startswith("test_") or p.stem == "conftest"}


def forbidden(name: str, bare_names: set[str]) -> bool:
    if name == "tests":
        return False
    if name.startswith("tests."):
        return not (name == SUPPORT or name.startswith(SUPPORT + "."))
    # `import test_kernels` / `from conftest import x`: a test module found on sys.path.
    return name.split(".")[0] in bare_names


def layout_violations() -> list[str]:
    bare_names = bare_test_module_names()
    problems = []
    for path in python_files():
        lines_seen = set()  # `from tests.test_x import a, b`: one report for the line
        for line, name in imported_modules(path):
            if forbidden(name, bare_names) and line not in lines_seen:
                lines_seen.add(line)
                problems.append(f"{path.relative_to(TESTS.parent)}:{line} imports {name}")
    return problems


def test_no_test_module_imports_another_test_module():
    """Only tests.support (and third-party / project packages) may be imported from tests."""
    problems = layout_violations()
    assert not problems, (
        "move what these import into tests/support/ (or a conftest.py fixture):\n  "
        + "\n  ".join(problems))


def test_tests_root_holds_only_conftest_and_init():
    stray = sorted(p.name for p in TESTS.glob("*.py") if p.name not in ROOT_FILES_ALLOWED)
    assert not stray, f"tests/ root holds {stray}: put each in a folder by what it tests"


def test_every_folder_of_tests_is_a_package():
    """Test folders carry __init__.py, so two files of one basename in different folders
    are different modules (tests.kernels.test_x, tests.engine.test_x), not a clash."""
    missing = sorted(
        str(p.parent.relative_to(TESTS.parent)) for p in TESTS.rglob("test_*.py")
        if "__pycache__" not in p.parts and not (p.parent / "__init__.py").exists())
    assert not missing, f"folders with tests but no __init__.py: {sorted(set(missing))}"


def test_the_check_sees_every_kind_of_import(tmp_path, monkeypatch):
    """The parser on a file written out by hand: absolute, relative, bare and nested."""
    package = tmp_path / "tests" / "engine"
    package.mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "test_other.py").write_text("")
    sample = package / "test_sample.py"
    sample.write_text(
        "import os\n"
        "from tests.support.bench import x\n"
        "from tests.engine.test_other import helper\n"
        "from . import test_other\n"
        "from .test_other import helper\n"
        "def f():\n"
        "    import test_other\n")
    monkeypatch.setattr(sys.modules[__name__], "TESTS", tmp_path / "tests")
    names = {name for _, name in imported_modules(sample)}
    assert {"tests.support.bench", "tests.engine.test_other", "tests.engine.test_other.helper",
            "test_other"} <= names
    bad = sorted({line for line, name in imported_modules(sample)
                  if forbidden(name, {"test_other", "test_sample"})})
    assert bad == [3, 4, 5, 7]
