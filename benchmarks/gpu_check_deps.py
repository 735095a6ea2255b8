"""The wheels benchmarks/gpu_check.sh carries to a GPU machine with no registry: fetch
them, and check, here on the CPU, that they are complete and installable there.

    python -m benchmarks.gpu_check_deps fetch              # pip download into .whl/
    python -m benchmarks.gpu_check_deps check-wheels       # manifest <-> .whl, their needs
    python -m benchmarks.gpu_check_deps record OUT -m pytest ...   # run, note what it imported
    python -m benchmarks.gpu_check_deps check-imports OUT...       # each import is there
    python -m benchmarks.gpu_check_deps travel-size        # the run's upload <= 64 MiB

The target: Python 3.12 (CPython), Linux x86-64, the packages of
benchmarks/gpu_preinstalled.txt, plus the wheels of benchmarks/gpu_wheels.txt.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.abc
import json
import runpy
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
MANIFEST = REPO_ROOT / "benchmarks" / "gpu_wheels.txt"
PREINSTALLED = REPO_ROOT / "benchmarks" / "gpu_preinstalled.txt"
WHEEL_DIR = REPO_ROOT / ".whl"
TRAVEL_LIMIT_BYTES = 64 << 20
PYTHON_VERSION = "3.12"
# pip matches manylinux_2_N exactly: every N a wheel of ours may carry.
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
# PEP 508 marker values on the GPU machine.
TARGET_ENV = {"python_version": PYTHON_VERSION, "python_full_version": "3.12.3",
              "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
# Import names of the project itself: they travel as source.
PROJECT_PACKAGES = {"engine", "server", "pagedserve_kernels", "benchmarks", "tests"}


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: Version | None  # None: the name alone is known


def read_pins(path: Path) -> dict[str, Pin]:
    """`name==version` or `name` lines; `#` starts a comment."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        pin = Pin(canonicalize_name(name), Version(version) if version else None)
        pins[pin.name] = pin
    return pins


def pip_platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


# ---------------------------------------------------------------------------- fetch
def fetch(wheel_dir: Path) -> None:
    """Download every manifest wheel for the target; drop wheels no longer listed."""
    wheel_dir.mkdir(exist_ok=True)
    specs = [f"{p.name}=={p.version}" for p in read_pins(MANIFEST).values()]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    *pip_platform_args(), "-d", str(wheel_dir), *specs], check=True)
    wanted = read_pins(MANIFEST)
    for wheel in wheel_dir.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name not in wanted or wanted[name].version != version:
            wheel.unlink()


# ---------------------------------------------------------------------------- wheels
def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the target (extras not asked for: skipped)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(archive.read(name).decode())
    requirements = [Requirement(r) for r in message.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def check_wheels(wheel_dir: Path) -> list[str]:
    """Problems: a manifest wheel missing, an unlisted or duplicate wheel, a need that
    neither a carried wheel nor the image meets."""
    problems = []
    manifest, image = read_pins(MANIFEST), read_pins(PREINSTALLED)
    carried: dict[str, Pin] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if name in carried:
            problems.append(f"two wheels of {name}: pip would refuse the install")
        carried[name] = Pin(name, version)
        if name not in manifest or manifest[name].version != version:
            problems.append(f"{wheel.name} is not in {MANIFEST.name}")
    for pin in manifest.values():
        if pin.name not in carried:
            problems.append(f"{pin.name}=={pin.version} has no wheel in {wheel_dir}: fetch")
    for wheel in sorted(wheel_dir.glob("*.whl")):
        for requirement in wheel_requirements(wheel):
            need = canonicalize_name(requirement.name)
            have = carried.get(need) or image.get(need)
            if have is None:
                problems.append(f"{wheel.name} needs {requirement}: neither carried nor there")
            elif have.version is not None and not requirement.specifier.contains(
                    have.version, prereleases=True):
                problems.append(f"{wheel.name} needs {requirement}, finds {need}=={have.version}")
    return problems


# ---------------------------------------------------------------------------- imports
class ImportEdges(importlib.abc.MetaPathFinder):
    """Notes, for each top-level package, the top-level package of the module that first
    imported it (a meta-path finder that finds nothing: it only watches)."""

    def __init__(self) -> None:
        self.importer_of: dict[str, str] = {}

    def find_spec(self, fullname, path=None, target=None):
        if "." not in fullname and fullname not in self.importer_of:
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(
                    ("importlib", "_frozen_importlib")):
                frame = frame.f_back
            importer = frame.f_globals.get("__name__", "") if frame is not None else ""
            self.importer_of[fullname] = importer.split(".", 1)[0]
        return None


def record(out: Path, argv: list[str]) -> None:
    """Run `-m module args...` (or `script args...`) here; at exit, write which third-party
    package each imported top-level package was first imported by."""
    edges = ImportEdges()
    sys.meta_path.insert(0, edges)

    def dump() -> None:
        owners = metadata.packages_distributions()
        seen = {top: dict(importer=importer,
                          distributions=sorted(canonicalize_name(d) for d in owners.get(top, [])))
                for top, importer in edges.importer_of.items()
                if top in sys.modules and top not in sys.stdlib_module_names
                and top not in PROJECT_PACKAGES and not top.startswith("_")}
        out.write_text(json.dumps(seen, indent=1, sort_keys=True))

    atexit.register(dump)
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


def image_closure(image: dict[str, Pin]) -> set[str]:
    """The image's packages and, as installed here, everything they require."""
    closure, todo = set(), list(image)
    while todo:
        name = todo.pop()
        if name in closure:
            continue
        closure.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(TARGET_ENV):
                todo.append(canonicalize_name(requirement.name))
    return closure


def check_imports(records: list[Path]) -> list[str]:
    """Each package imported by the project (or by a carried wheel) must be carried or
    in the image. What the image's own packages import is the image's to provide: on
    this machine they may be other versions, with other optional imports."""
    carried = set(read_pins(MANIFEST))
    image = image_closure(read_pins(PREINSTALLED))
    owners = metadata.packages_distributions()
    problems = []
    for path in records:
        for top, seen in json.loads(path.read_text()).items():
            dists = set(seen["distributions"])
            if not dists or dists & (carried | image):
                continue  # no distribution (a namespace, a local module), or provided
            importer = seen["importer"]
            ours = importer in PROJECT_PACKAGES or importer in ("__main__", "")
            importer_dists = {canonicalize_name(d) for d in owners.get(importer, [])}
            if not ours and not importer_dists & carried:
                continue  # imported by one of the image's packages (or their shims)
            problems.append(f"{path.name}: {importer or '?'} imports {top} "
                            f"({', '.join(sorted(dists))}): neither carried nor there")
    return problems


# ---------------------------------------------------------------------------- size
def travel_size(wheel_dir: Path) -> int:
    """Bytes the device tool uploads: tracked and untracked-not-ignored files, and .whl."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=REPO_ROOT, capture_output=True,
                            check=True).stdout.split(b"\0")
    files = [REPO_ROOT / name.decode() for name in listed if name]
    files += list(wheel_dir.glob("*.whl"))
    return sum(f.stat().st_size for f in files if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--whl", type=Path, default=WHEEL_DIR)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fetch")
    commands.add_parser("check-wheels")
    rec = commands.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("argv", nargs=argparse.REMAINDER)
    imports = commands.add_parser("check-imports")
    imports.add_argument("records", type=Path, nargs="+")
    commands.add_parser("travel-size")
    args = parser.parse_args(argv)

    if args.command == "fetch":
        fetch(args.whl)
        return 0
    if args.command == "record":
        record(args.out, args.argv)
        return 0
    if args.command == "travel-size":
        size = travel_size(args.whl)
        print(f"travels: {size / 2**20:.1f} MiB of {TRAVEL_LIMIT_BYTES >> 20} MiB")
        return 0 if size <= TRAVEL_LIMIT_BYTES else 1
    problems = (check_wheels(args.whl) if args.command == "check-wheels"
                else check_imports(args.records))
    for problem in problems:
        print(f"  {problem}")
    what = "wheels" if args.command == "check-wheels" else "imports"
    print(f"{what}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
