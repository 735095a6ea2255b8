"""Helpers for tests/deploy/test_router_deploy.py (several replicas behind a router).

* `kustomize_build(dir)`: the resources a kustomization renders, for the subset of kustomize
  these manifests use (resources: files and directories; labels without selectors; images),
  so the manifests can be checked where kubectl is missing; `kubectl_kustomize(dir)` is the
  real build (a test compares the two).
* vllm-router: its binary, the flags its --help lists, its own argument parser, and
  `running_router(args)` that starts the binary in front of `FakeWorker`s (HTTP servers
  that answer everything with 200 and record what the router asked) after `localize()`
  pointed the manifest's hosts and ports at them.
* `server_routes()`: the pagedserve app's routes (path -> methods).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import yaml

from tests.support.server_fixtures import stop_process

REPO_ROOT = Path(__file__).resolve().parents[2]
K8S = REPO_ROOT / "deploy" / "kubernetes"
ROUTER_DIR = K8S / "router"
REPLICAS_DIR = ROUTER_DIR / "replicas"
KV_AWARE_DIR = ROUTER_DIR / "kv-aware"
POOL_DIR = K8S / "inference-pool"
KUSTOMIZATIONS = (ROUTER_DIR, REPLICAS_DIR, KV_AWARE_DIR, POOL_DIR)
ROUTER_DOCKERFILE = ROUTER_DIR / "vllm-router.Dockerfile"
COMPOSE_ROUTER = REPO_ROOT / "deploy" / "compose" / "router.yaml"

# The endpoint picker's flags in GIE v1.5.0 (kubernetes-sigs/gateway-api-inference-extension:
# pkg/epp/server/options.go AddFlags, plus the zap/klog logging flags it adds).
EPP_FLAGS = frozenset({
    "--grpc-port", "--ha-enable-leader-election", "--pool-group", "--pool-namespace",
    "--pool-name", "--endpoint-selector", "--endpoint-target-ports",
    "--disable-endpoint-subset-filter", "--model-server-metrics-scheme",
    "--model-server-metrics-path", "--model-server-metrics-port",
    "--model-server-metrics-https-insecure-skip-verify", "--refresh-metrics-interval",
    "--refresh-prometheus-metrics-interval", "--metrics-staleness-threshold",
    "--total-queued-requests-metric", "--total-running-requests-metric",
    "--kv-cache-usage-percentage-metric", "--lora-info-metric", "--cache-info-metric",
    "--tracing", "--health-checking", "--metrics-port", "--grpc-health-port", "--enable-pprof",
    "--cert-path", "--enable-cert-reload", "--secure-serving", "--metrics-endpoint-auth",
    "--config-file", "--config-text", "--v", "--zap-encoder", "--zap-log-level",
    "--zap-devel", "--zap-stacktrace-level", "--zap-time-encoding",
})
# The series that EPP reads by default (the same options.go: NewOptions), under vLLM's names.
EPP_METRICS = ("vllm:num_requests_waiting", "vllm:num_requests_running",
               "vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info")


# ------------------------------------------------------------------------------------------
# YAML and kustomize


def yaml_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "labels", "images"}


def kustomize_build(directory: Path) -> list[dict]:
    """What `kubectl kustomize directory` renders, for the fields these kustomizations use
    (others raise, so a new one cannot go unchecked)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    if unknown:
        raise ValueError(f"{directory}: kustomize_build does not render {sorted(unknown)}")
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            docs += kustomize_build(path)
        else:
            if not path.is_relative_to(directory.resolve()):
                raise ValueError(f"{directory}: kustomize refuses files outside the root: "
                                 f"{resource}")
            docs += yaml_documents(path)
    docs = json.loads(json.dumps(docs))  # copies: the transformers below edit in place
    for entry in kustomization.get("labels", []):
        if entry.get("includeSelectors") or entry.get("includeTemplates") \
                or set(entry) - {"pairs", "includeSelectors"}:
            raise ValueError(f"{directory}: only metadata labels are rendered: {entry}")
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for image in kustomization.get("images", []):
        for container in _containers(docs):
            name = re.split(r"[@]|:(?=[^/]*$)", container["image"])[0]
            if name == image["name"]:
                new = image.get("newName", name)
                container["image"] = f"{new}:{image['newTag']}" if "newTag" in image else new
    return docs


def _containers(docs: list[dict]) -> Iterator[dict]:
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec", {}) if doc.get("kind") != "Pod" else spec
        for key in ("containers", "initContainers"):
            yield from pod.get(key, [])


def kubectl() -> str | None:
    return shutil.which("kubectl")


def kubectl_kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory}: {result.stderr}")
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def by_key(docs: list[dict]) -> dict[tuple[str, str], dict]:
    out = {}
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in out, f"two {key[0]} named {key[1]}"
        out[key] = doc
    return out


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def selector_matches(selector: dict, labels: dict) -> bool:
    """A matchLabels selector (or a plain Service selector) against pod labels."""
    match = selector.get("matchLabels", selector) if set(selector) <= {"matchLabels"} \
        else selector
    assert match, "an empty selector selects everything"
    return all(labels.get(k) == v for k, v in match.items())


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def container(workload: dict, name: str | None = None) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(containers) == 1
        return containers[0]
    return next(c for c in containers if c["name"] == name)


def container_ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def resolve_port(c: dict, port: int | str) -> int:
    """A probe's or a Service's targetPort (a name or a number) as the container port."""
    ports = container_ports(c)
    if isinstance(port, str):
        assert port in ports, f"{c['name']} has no port named {port}: {ports}"
        return ports[port]
    assert port in ports.values(), f"{c['name']} does not listen on {port}: {ports}"
    return port


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) in args as the kubelet expands them from the container's env."""
    out = []
    for arg in args:
        for name in re.findall(r"\$\((\w+)\)", arg):
            assert name in env, f"{arg!r}: $({name}) is not in the container's env"
            arg = arg.replace(f"$({name})", env[name])
        out.append(arg)
    return out


def flag_values(args: list[str], flag: str) -> list[list[str]]:
    """The values after each occurrence of `flag` (up to the next --flag)."""
    out = []
    for i, token in enumerate(args):
        if token == flag:
            values = []
            for value in args[i + 1:]:
                if value.startswith("--"):
                    break
                values.append(value)
            out.append(values)
    return out


def flag_value(args: list[str], flag: str) -> str | None:
    found = flag_values(args, flag)
    assert len(found) <= 1, f"{flag} given {len(found)} times"
    if not found:
        return None
    assert len(found[0]) == 1, f"{flag}: {found[0]}"
    return found[0][0]


def host_port(url: str) -> tuple[str, str, int]:
    match = re.fullmatch(r"(\w+)://([^:/]+):(\d+)/?", url)
    assert match, f"not scheme://host:port: {url}"
    return match.group(1), match.group(2), int(match.group(3))


# ------------------------------------------------------------------------------------------
# The pagedserve server


_ROUTES: dict[str, set[str]] = {}


def server_routes() -> dict[str, set[str]]:
    """path -> methods of the FastAPI app (built on a mock state: routes only)."""
    if not _ROUTES:
        from server.http.app import build_app

        app = build_app(mock.MagicMock(name="state"))
        for route in app.routes:
            path = getattr(route, "path", None)
            if path is not None:
                _ROUTES.setdefault(path, set()).update(getattr(route, "methods", None) or {"*"})
    return _ROUTES


def served(method: str, path: str) -> bool:
    methods = server_routes().get(path.split("?")[0])
    return methods is not None and (method in methods or "*" in methods)


# ------------------------------------------------------------------------------------------
# vllm-router


def router_binary() -> str | None:
    return shutil.which("vllm-router", path=sysconfig.get_path("scripts")) or shutil.which(
        "vllm-router")


def router_help_flags(binary: str) -> set[str]:
    result = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    options = result.stdout.split("options:", 1)[-1]
    flags = set(re.findall(r"^\s{2}(--[a-z0-9-]+)", options, re.M))
    flags |= set(re.findall(r",\s(--[a-z0-9-]+)", options))
    assert "--policy" in flags and "--worker-urls" in flags, "could not read vllm-router --help"
    return flags


def parse_router_args(args: list[str]):
    """vllm-router's own parsing (RouterArgs) and checks; an error is a ValueError."""
    from vllm_router.launch_router import parse_router_args as parse

    with contextlib.redirect_stderr(None):
        try:
            router_args = parse(args)
        except SystemExit as exc:
            raise ValueError(f"vllm-router rejects {args}") from exc
    router_args._validate_router_args()
    return router_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeWorker:
    """An HTTP server that answers every request with 200 and a small JSON body, and
    records (method, path, Authorization) of each."""

    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                worker.requests.append((self.command, self.path,
                                        self.headers.get("authorization")))
                body = json.dumps({
                    "object": "list", "id": "fake", "data": [{"id": "fake", "object": "model"}],
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": "ok"}}],
                }).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def localize(args: list[str], workers: dict[str, FakeWorker]) -> tuple[list[str], dict]:
    """The router's args with its listen addresses on free loopback ports, each worker URL
    in `workers` replaced by its fake's and each tcp:// endpoint by a free loopback one.
    Returns the args and the replacements (old -> new)."""
    replace = {url: worker.url for url, worker in workers.items()}
    for endpoint in sorted(set(re.findall(r"tcp://[^\s=,]+:\d+", " ".join(args)))):
        replace[endpoint] = f"tcp://127.0.0.1:{free_port()}"
    out = []
    for token in args:
        for old in sorted(replace, key=len, reverse=True):
            token = token.replace(old, replace[old])
        out.append(token)
    for flag, value in (("--host", "127.0.0.1"), ("--prometheus-host", "127.0.0.1"),
                        ("--port", None), ("--prometheus-port", None)):
        if flag in out:
            out[out.index(flag) + 1] = value or str(free_port())
    return out, replace


@contextlib.contextmanager
def running_router(binary: str, args: list[str], timeout: float = 60,
                   ready_path: str = "/liveness") -> Iterator[str]:
    """The router started with `args` (already localized, `--port` among them); yields its
    URL once `ready_path` answers 200 (/v1/models: once it has healthy workers); fails with
    the end of its log if it exits first or is not ready within `timeout` seconds. Its output
    goes to a temporary file, which a chatty router cannot fill up as it can a pipe."""
    import httpx

    url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    with tempfile.TemporaryFile("w+") as log:
        router = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT,
                                  text=True)
        try:
            deadline = time.monotonic() + timeout
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + ready_path, timeout=2).status_code == 200:
                        break
                if router.poll() is not None or time.monotonic() > deadline:
                    router.kill()
                    router.wait(10)
                    log.seek(0)
                    raise AssertionError(f"vllm-router {' '.join(args)} did not start:\n"
                                         + re.sub(r"\x1b\[[0-9;]*m", "", log.read())[-4000:])
                time.sleep(0.2)
            yield url
        finally:
            stop_process(router, 10)


def compose_interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default} with `env` (default: unset);
    ${VAR:?message} and ${VAR?message} raise ValueError(message) where VAR is missing (or,
    with the colon, empty), as compose refuses to start."""
    env = env or {}

    def one_var(match: re.Match) -> str:
        name, op, default = match.group(1), match.group(2), match.group(3) or ""
        if name in env and (env[name] or not (op or "").startswith(":")):
            return env[name]
        if op and op.endswith("?"):
            raise ValueError(f"{name}: {default}")
        return default if op else ""

    return re.sub(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}", one_var, value)
