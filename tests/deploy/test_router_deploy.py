"""Static and live checks of the files that run several pagedserve replicas behind a router
(docs/deploy.md, "Several replicas behind a router"):

* deploy/kubernetes/router/ (cache_aware, service discovery), router/kv-aware/ (kv_aware,
  the replicas' KV events), router/replicas/ (their StatefulSet, headless Service, PDB),
  deploy/kubernetes/inference-pool/ (GIE InferencePool, endpoint picker, Gateway, HTTPRoute):
  every file parses and is in a kustomization; the rendering (kubectl kustomize where
  installed) validates against the Kubernetes schemas (strict) and, for the Gateway API
  kinds, against tests/data/schemas/; the relations hold: selectors, port names and
  numbers, RBAC for service discovery and the EPP, the router's worker URLs and KV-event
  sources against the StatefulSet, headless Service and each replica's --kv-events-config,
  --kv-event-block-size / --kv-event-model against the replicas' flags, probes on routes
  the server serves, startup budgets.
* deploy/compose/router.yaml: the Compose Specification schema; services, build contexts
  and targets, healthchecks on served routes and the right ports, depends_on with
  service_healthy on services that have a healthcheck, the router's worker URLs.
* vllm-router (the real binary, skipped where it is not installed): every flag the files
  give it is in its --help and passes its own parser; the kv_aware and compose routers start
  with exactly those args (hosts pointed at fake workers), answer the probe paths, subscribe
  to the event endpoints, and ask the workers only routes pagedserve serves.
* Each replica's flags and PAGEDSERVE_* variables parse with `pagedserve serve`'s parser;
  the metrics the EPP reads are exported under vLLM's names with the replicas' flags.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import router_deploy as rd
from tests.support.kubernetes_schemas import (
    assert_valid_kubernetes,
    compose_spec_errors,
    crd_validator,
)

ROOT = rd.REPO_ROOT
DOCKERFILE = ROOT / "Dockerfile"
DOCS = ROOT / "docs" / "deploy.md"
SECRET = ("pagedserve-api-key", "api-key")  # ../secret.example.yaml, the base Deployment's key

KIND_API = {
    "Deployment": "apps/v1", "StatefulSet": "apps/v1", "Service": "v1", "ConfigMap": "v1",
    "ServiceAccount": "v1", "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1", "PodDisruptionBudget": "policy/v1",
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1", "Gateway": "gateway.networking.k8s.io/v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}
CRD_KINDS = {"InferencePool", "HTTPRoute", "Gateway"}
MANIFEST_DIRS = (rd.ROUTER_DIR, rd.POOL_DIR)


def rendered(directory: Path) -> list[dict]:
    return rd.kustomize_build(directory)


# ------------------------------------------------------------------------------------------
# pagedserve serve's parser


def serve_parser():
    from server.http.cli import make_arg_parser

    return make_arg_parser()


def env_flag(name: str) -> str:
    return "--" + name.removeprefix("PAGEDSERVE_").lower().replace("_", "-")


def parse_serve(args: list[str], env: dict[str, str | None], where: str):
    """The replica's flags and PAGEDSERVE_* variables as `pagedserve serve` parses them
    (a variable is its flag; PAGEDSERVE_CACHE is not a flag)."""
    parser = serve_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    tokens = []
    for name, value in env.items():
        if not name.startswith("PAGEDSERVE_") or name == "PAGEDSERVE_CACHE":
            continue
        assert env_flag(name) in flags, f"{where}: {name} is not a `pagedserve serve` variable"
        if value is not None:
            tokens += [env_flag(name), value]
    for token in args:
        if token.startswith("--"):
            assert token.split("=")[0] in flags, f"{where}: `pagedserve serve` has no {token}"
    try:
        return parser.parse_args(tokens + list(args))
    except SystemExit:
        pytest.fail(f"{where}: `pagedserve serve {shlex.join(tokens + list(args))}` is rejected")


def replica_env(c: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value", "<from secret>" if "valueFrom" in e else None)
            for e in c.get("env", [])}


# ------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def router_bin() -> str:
    binary = rd.router_binary()
    if binary is None:
        pytest.skip("vllm-router is not installed (PyPI `vllm-router`, in the test extra)")
    return binary


@pytest.fixture(scope="module")
def router_flags(router_bin) -> set[str]:
    return rd.router_help_flags(router_bin)


@pytest.fixture(scope="module")
def replicas() -> dict:
    docs = rendered(rd.REPLICAS_DIR)
    sts = rd.one(docs, "StatefulSet")
    c = rd.container(sts, "pagedserve")
    return {"docs": docs, "sts": sts, "service": rd.one(docs, "Service"),
            "pdb": rd.one(docs, "PodDisruptionBudget"), "container": c,
            "args": parse_serve(c.get("args", []), replica_env(c), "replica StatefulSet")}


def router_deployment(directory: Path) -> dict:
    return rd.one(rendered(directory), "Deployment", "vllm-router")


def router_args(directory: Path, env_values: dict[str, str] | None = None) -> list[str]:
    """The router container's args, $(VAR) expanded (secrets and fieldRefs as samples)."""
    c = rd.container(router_deployment(directory), "vllm-router")
    env = {e["name"]: e.get("value", f"sample-{e['name'].lower()}") for e in c.get("env", [])}
    env.update(env_values or {})
    return rd.expand(c["args"], env)


# ------------------------------------------------------------------------------------------
# files, kinds, kustomizations, schemas


def all_yaml_files() -> list[Path]:
    files = [p for d in MANIFEST_DIRS for p in sorted(d.rglob("*.yaml"))]
    return files + [rd.COMPOSE_ROUTER]


def test_every_yaml_file_parses_with_the_expected_kinds_and_api_versions():
    kinds = set()
    for path in all_yaml_files():
        docs = rd.yaml_documents(path)
        assert docs, f"{path} is empty"
        if path == rd.COMPOSE_ROUTER:
            continue
        for doc in docs:
            kind = doc.get("kind")
            assert kind in KIND_API, f"{path}: unexpected kind {kind}"
            assert doc.get("apiVersion") == KIND_API[kind], (
                f"{path}: {kind} is {KIND_API[kind]}, not {doc.get('apiVersion')}")
            kinds.add(kind)
            if kind != "Kustomization":
                assert doc["metadata"]["name"], f"{path}: {kind} without a name"
                assert "namespace" not in doc["metadata"], (
                    f"{path}: {kind} names a namespace; `kubectl apply -n` sets it")
    assert kinds == set(KIND_API), f"kinds never used: {set(KIND_API) - kinds}"


def test_every_manifest_is_in_a_kustomization():
    listed: set[Path] = set()
    for directory in rd.KUSTOMIZATIONS:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert kustomization["kind"] == "Kustomization"
        for resource in kustomization["resources"]:
            path = (directory / resource).resolve()
            assert path.exists(), f"{directory}/kustomization.yaml lists missing {resource}"
            if path.is_dir():
                assert (path / "kustomization.yaml").is_file(), f"{path} is no kustomization"
            else:
                assert path.parent == directory.resolve(), f"{resource}: outside {directory}"
                listed.add(path)
    manifests = {p.resolve() for d in MANIFEST_DIRS for p in d.rglob("*.yaml")
                 if p.name != "kustomization.yaml"}
    assert manifests - listed == set(), f"in no kustomization: {sorted(manifests - listed)}"
    assert {d.resolve() for d in rd.KUSTOMIZATIONS} == {
        p.parent.resolve() for d in MANIFEST_DIRS for p in d.rglob("kustomization.yaml")}


@pytest.mark.parametrize("directory", rd.KUSTOMIZATIONS, ids=lambda d: d.name)
def test_rendering_matches_kubectl_kustomize(directory):
    """The renderer the other tests use gives what kustomize itself builds."""
    if rd.kubectl() is None:
        pytest.skip("kubectl is not installed (its built-in kustomize checks the renderer)")
    ours = rd.by_key(rendered(directory))
    theirs = rd.by_key(rd.kubectl_kustomize(directory))
    assert ours.keys() == theirs.keys()
    for key, doc in ours.items():
        assert doc == theirs[key], f"{directory.name}: {key} differs from kubectl kustomize"


@pytest.mark.parametrize("directory", [rd.ROUTER_DIR, rd.KV_AWARE_DIR, rd.POOL_DIR],
                         ids=lambda d: d.name)
def test_rendered_manifests_validate_against_schemas(directory):
    for doc in rendered(directory):
        name = f"{directory.name}: {doc['kind']} {doc['metadata']['name']}"
        if doc["kind"] in CRD_KINDS:
            errors = [f"{list(e.path)}: {e.message}"
                      for e in crd_validator(doc["kind"], doc["apiVersion"]).iter_errors(doc)]
            assert not errors, f"{name}: " + "\n".join(errors)
            continue
        assert_valid_kubernetes(doc, name)


def test_crd_schemas_reject_mistakes():
    docs = rendered(rd.POOL_DIR)
    for kind, mistakes in {
        "InferencePool": [
            lambda d: d["spec"].update(targetPortNumber=8000),  # the v1alpha2 field
            lambda d: d["spec"]["targetPorts"][0].update(number="8000"),
            lambda d: d["spec"]["endpointPickerRef"].pop("port"),
            lambda d: d["spec"]["endpointPickerRef"].update(failureMode="failOpen"),
            lambda d: d["spec"].update(selector={"app": "pagedserve"}),
        ],
        "HTTPRoute": [
            lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(nmae="x"),
            lambda d: d["spec"]["rules"][0]["timeouts"].update(request="5 minutes"),
            lambda d: d["spec"]["rules"][0]["backendRefs"][0].update(kind="Service"),
        ],
        "Gateway": [
            lambda d: d["spec"].pop("gatewayClassName"),
            lambda d: d["spec"]["listeners"][0].update(port="80"),
        ],
    }.items():
        doc = rd.one(docs, kind)
        validator = crd_validator(kind, doc["apiVersion"])
        assert validator.is_valid(doc)
        for mistake in mistakes:
            bad = copy.deepcopy(doc)
            mistake(bad)
            assert not validator.is_valid(bad), f"{kind} schema accepts {bad['spec']}"


def test_kustomizations_point_images_at_the_same_tags():
    base = yaml.safe_load((rd.K8S / "kustomization.yaml").read_text())
    (pagedserve,) = [i for i in base["images"] if i["name"] == "pagedserve"]
    dockerfile_version = re.search(r"ARG VLLM_ROUTER_VERSION=(\S+)",
                                   rd.ROUTER_DOCKERFILE.read_text()).group(1)
    compose = yaml.safe_load(rd.COMPOSE_ROUTER.read_text())
    assert compose["services"]["router"]["image"] == f"vllm-router:{dockerfile_version}"
    for directory in (rd.ROUTER_DIR, rd.KV_AWARE_DIR, rd.POOL_DIR):
        images = {i["name"]: i for i in
                  yaml.safe_load((directory / "kustomization.yaml").read_text())["images"]}
        assert images["pagedserve"] == pagedserve, directory
        for c in rd._containers(rendered(directory)):
            name, _, tag = c["image"].rpartition(":")
            assert tag and tag != "latest", f"{directory.name}: {c['image']} has no fixed tag"
            if c["name"] == "vllm-router":
                assert tag == dockerfile_version == images["vllm-router"]["newTag"]


# ------------------------------------------------------------------------------------------
# the replicas


def test_replicas_contract(replicas):
    sts, c, args = replicas["sts"], replicas["container"], replicas["args"]
    spec = sts["spec"]["template"]["spec"]
    env = replica_env(c)
    assert rd.selector_matches(sts["spec"]["selector"], rd.pod_labels(sts))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "command" not in c, "keep the image's entrypoint (pagedserve serve)"
    assert args.host == "0.0.0.0", "the router and the EPP reach the replicas over the network"
    assert rd.container_ports(c)["http"] == args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert rd.served("GET", get["path"]), f"replica {probe}: {get['path']} is not served"
        assert rd.resolve_port(c, get["port"]) == args.port, probe
    # Drain: grace period > preStop sleep + the server's shutdown timeout.
    sleep = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > sleep + args.shutdown_timeout
    # API key from the Secret the base Deployment uses.
    (key,) = [e for e in c["env"] if e["name"] == "PAGEDSERVE_API_KEY"]
    ref = key["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == SECRET
    # Model cache: a volume claim per replica, holding HF_HOME and PAGEDSERVE_CACHE.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    cache = mounts[claim["metadata"]["name"]]
    for var in ("HF_HOME", "PAGEDSERVE_CACHE"):
        assert env[var].startswith(cache.rstrip("/") + "/"), var
    shm = next(v for v in spec["volumes"] if v["name"] == next(
        n for n, p in mounts.items() if p == "/dev/shm"))
    assert shm["emptyDir"]["medium"] == "Memory"
    # Same image as the single Deployment.
    base = yaml.safe_load((rd.K8S / "deployment.yaml").read_text())
    assert c["image"] == base["spec"]["template"]["spec"]["containers"][0]["image"]


def test_replicas_headless_service_and_pdb(replicas):
    sts, service, c = replicas["sts"], replicas["service"], replicas["container"]
    assert sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None", "the router needs one name per pod"
    assert rd.selector_matches(service["spec"]["selector"], rd.pod_labels(sts))
    for port in service["spec"]["ports"]:
        assert rd.resolve_port(c, port["targetPort"]) == port["port"], port
    assert {p["name"] for p in service["spec"]["ports"]} == set(rd.container_ports(c))
    assert rd.selector_matches(replicas["pdb"]["spec"]["selector"], rd.pod_labels(sts))
    # The replicas are not the single Deployment's pods (its Service, PDB, HPA).
    base = yaml.safe_load((rd.K8S / "deployment.yaml").read_text())
    assert not rd.selector_matches(sts["spec"]["selector"], rd.pod_labels(base))
    assert not rd.selector_matches(base["spec"]["selector"], rd.pod_labels(sts))


def test_replicas_publish_kv_events_where_the_service_says(replicas):
    args, c, service = replicas["args"], replicas["container"], replicas["service"]
    events = args.kv_events_config
    assert events is not None and events.enabled, "--kv-events-config does not publish"
    scheme, host, port = rd.host_port(events.endpoint)
    assert scheme == "tcp" and host in ("*", "0.0.0.0"), (
        f"{events.endpoint}: the router connects from another pod")
    assert rd.container_ports(c)["kv-events"] == port
    (svc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "kv-events"]
    assert svc_port["port"] == port
    assert args.enable_prefix_caching, "no prefix cache, no KV events worth routing on"


# ------------------------------------------------------------------------------------------
# the routers (Kubernetes)


def router_service_and_pod(directory: Path):
    docs = rendered(directory)
    return docs, rd.one(docs, "Service", "vllm-router"), rd.one(docs, "Deployment", "vllm-router")


@pytest.mark.parametrize("directory", [rd.ROUTER_DIR, rd.KV_AWARE_DIR], ids=lambda d: d.name)
def test_router_pod_contract(directory, replicas):
    docs, service, deployment = router_service_and_pod(directory)
    c = rd.container(deployment, "vllm-router")
    args = router_args(directory)
    assert rd.flag_value(args, "--host") == "0.0.0.0"
    assert rd.flag_value(args, "--prometheus-host") == "0.0.0.0"
    ports = rd.container_ports(c)
    assert ports["http"] == int(rd.flag_value(args, "--port"))
    assert ports["metrics"] == int(rd.flag_value(args, "--prometheus-port"))
    assert rd.selector_matches(service["spec"]["selector"], rd.pod_labels(deployment))
    assert not rd.selector_matches(service["spec"]["selector"], rd.pod_labels(replicas["sts"]))
    for port in service["spec"]["ports"]:
        assert rd.resolve_port(c, port["targetPort"]) == ports[port["name"]]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in ROUTER_PROBE_PATHS, probe
        assert rd.resolve_port(c, c[probe]["httpGet"]["port"]) == ports["http"], probe
    # It listens once its workers are healthy: the startup probe waits as long as the
    # router does, which is as long as a replica may take to load.
    startup = c["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    wait = int(rd.flag_value(args, "--worker-startup-timeout-secs"))
    replica_startup = replicas["container"]["startupProbe"]
    assert budget >= wait >= replica_startup["periodSeconds"] * replica_startup["failureThreshold"]
    # Its own calls to the replicas carry their API key.
    raw = c["args"]
    key_var = re.fullmatch(r"\$\((\w+)\)", raw[raw.index("--api-key") + 1]).group(1)
    (env,) = [e for e in c["env"] if e["name"] == key_var]
    ref = env["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == SECRET
    # No other router: the replicas' Service is not the router's.
    assert service["metadata"]["name"] != replicas["service"]["metadata"]["name"]
    assert len([d for d in docs if d["kind"] == "Deployment"]) == 1


@pytest.mark.parametrize("directory", [rd.ROUTER_DIR, rd.KV_AWARE_DIR], ids=lambda d: d.name)
def test_router_args_are_vllm_router_flags(directory, router_flags):
    args = router_args(directory)
    used = {a.split("=")[0] for a in args if a.startswith("--")}
    assert used <= router_flags, f"not in vllm-router --help: {sorted(used - router_flags)}"
    parsed = rd.parse_router_args(args)
    assert parsed.policy == {"router": "cache_aware", "kv-aware": "kv_aware"}[directory.name]
    assert rd.served("GET", parsed.health_check_endpoint), parsed.health_check_endpoint


def test_router_checker_catches_mistakes(router_flags):
    args = router_args(rd.KV_AWARE_DIR)
    with pytest.raises(ValueError):
        rd.parse_router_args([*args, "--policy", "cache-aware"])
    with pytest.raises(ValueError):
        rd.parse_router_args([*args, "--kv-event-block-size", "sixteen"])
    assert "--worker-url" not in router_flags and "--service-discovery" in router_flags


def test_two_router_deployments_differ_only_in_how_they_find_workers():
    cache_aware = router_deployment(rd.ROUTER_DIR)
    kv_aware = router_deployment(rd.KV_AWARE_DIR)
    for deployment in (cache_aware, kv_aware):
        spec = deployment["spec"]["template"]["spec"]
        spec.pop("serviceAccountName", None)
        spec.pop("automountServiceAccountToken", None)
        c = rd.container(deployment, "vllm-router")
        c.pop("args")
        c["env"] = [e for e in c["env"] if e["name"] != "POD_NAMESPACE"]
    assert cache_aware == kv_aware
    assert rd.yaml_documents(rd.ROUTER_DIR / "service.yaml") == \
        rd.yaml_documents(rd.KV_AWARE_DIR / "service.yaml")


def test_cache_aware_router_discovers_the_replicas(replicas):
    docs, _, deployment = router_service_and_pod(rd.ROUTER_DIR)
    c = rd.container(deployment, "vllm-router")
    args = c["args"]
    parsed = rd.parse_router_args(router_args(rd.ROUTER_DIR))
    assert parsed.service_discovery and not parsed.worker_urls
    assert rd.selector_matches(parsed.selector, rd.pod_labels(replicas["sts"]))
    assert not rd.selector_matches(parsed.selector, rd.pod_labels(deployment)), (
        "the router would route to itself")
    assert parsed.service_discovery_port == replicas["args"].port
    # Its own namespace (so a Role is enough), from the downward API.
    namespace = rd.flag_value(args, "--service-discovery-namespace")
    var = re.fullmatch(r"\$\((\w+)\)", namespace).group(1)
    (env,) = [e for e in c["env"] if e["name"] == var]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # RBAC: its service account may get, list and watch pods.
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    rd.one(docs, "ServiceAccount", account)
    assert role_grants(docs, account, "", "pods") >= {"get", "list", "watch"}
    assert not [d for d in docs if d["kind"].startswith("Cluster")]


def role_grants(docs: list[dict], account: str, group: str, resource: str) -> set[str]:
    """Verbs the Roles bound to `account` grant on `resource` of API `group`."""
    verbs: set[str] = set()
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account
                   for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        assert ref["kind"] == "Role" and ref["apiGroup"] == "rbac.authorization.k8s.io"
        role = rd.one(docs, "Role", ref["name"])
        for rule in role["rules"]:
            if group in rule["apiGroups"] and resource in rule["resources"]:
                verbs |= set(rule["verbs"])
    return verbs


def test_kv_aware_router_names_each_replica_and_its_event_endpoint(replicas):
    sts, service, c = replicas["sts"], replicas["service"], replicas["container"]
    args = router_args(rd.KV_AWARE_DIR)
    parsed = rd.parse_router_args(args)
    assert parsed.policy == "kv_aware" and not parsed.service_discovery
    http_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "http")
    expected = [f"http://{sts['metadata']['name']}-{i}.{service['metadata']['name']}:{http_port}"
                for i in range(sts["spec"]["replicas"])]
    assert parsed.worker_urls == expected, "one worker per replica, by its stable name"
    _, _, event_port = rd.host_port(replicas["args"].kv_events_config.endpoint)
    assert event_port == rd.container_ports(c)["kv-events"]
    sources = {}
    for source in parsed.kv_event_source:
        url, _, endpoints = source.partition("=")
        assert url not in sources, f"two sources for {url}"
        sources[url] = endpoints.split(",")
    assert list(sources) == expected, "every worker needs its --kv-event-source"
    for url, endpoints in sources.items():
        (endpoint,) = endpoints
        scheme, host, port = rd.host_port(endpoint)
        assert (scheme, host, port) == ("tcp", rd.host_port(url)[1], event_port), endpoint
    assert parsed.kv_event_block_size == replicas["args"].block_size
    assert parsed.kv_event_model in replicas["args"].served_model_name
    assert not parsed.kv_event_replay_source, (
        "vllm-router reads 4-frame replay replies, pagedserve sends 3 (docs/apis.md)")


# ------------------------------------------------------------------------------------------
# InferencePool, endpoint picker, Gateway


@pytest.fixture(scope="module")
def pool_docs() -> list[dict]:
    return rendered(rd.POOL_DIR)


def test_inference_pool_selects_the_replicas(pool_docs, replicas):
    pool = rd.one(pool_docs, "InferencePool")
    epp = rd.one(pool_docs, "Deployment")
    sts = rd.one(pool_docs, "StatefulSet")
    assert rd.pod_labels(sts) == rd.pod_labels(replicas["sts"])
    assert rd.selector_matches(pool["spec"]["selector"], rd.pod_labels(sts))
    assert not rd.selector_matches(pool["spec"]["selector"], rd.pod_labels(epp))
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [replicas["args"].port]
    # The picker reference: the EPP Service's ext-proc port, the EPP's gRPC port.
    ref = pool["spec"]["endpointPickerRef"]
    service = rd.one(pool_docs, "Service", ref["name"])
    assert ref.get("kind", "Service") == "Service"
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    c = rd.container(epp, "epp")
    assert rd.resolve_port(c, port["targetPort"]) == rd.container_ports(c)["grpc"]
    assert rd.selector_matches(service["spec"]["selector"], rd.pod_labels(epp))


def test_endpoint_picker_contract(pool_docs, replicas):
    pool = rd.one(pool_docs, "InferencePool")
    epp = rd.one(pool_docs, "Deployment")
    c = rd.container(epp, "epp")
    env = {e["name"]: e for e in c["env"]}
    args = c["args"]
    used = {a.split("=")[0] for a in args if a.startswith("--")}
    assert used <= rd.EPP_FLAGS, f"not EPP v1.5.0 flags: {sorted(used - rd.EPP_FLAGS)}"
    assert rd.flag_value(args, "--pool-name") == pool["metadata"]["name"]
    assert rd.flag_value(args, "--pool-group") == pool["apiVersion"].split("/")[0]
    namespace = re.fullmatch(r"\$\((\w+)\)", rd.flag_value(args, "--pool-namespace")).group(1)
    assert env[namespace]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Its plugin config: a key of the mounted ConfigMap, every profile's plugin declared.
    config_file = Path(rd.flag_value(args, "--config-file"))
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volume = next(v for v in epp["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mounts[str(config_file.parent)])
    config_map = rd.one(pool_docs, "ConfigMap", volume["configMap"]["name"])
    config = yaml.safe_load(config_map["data"][config_file.name])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p.get("name", p["type"]): p for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        for plugin in profile["plugins"]:
            assert plugin["pluginRef"] in declared, plugin
    source = declared["metrics-data-source"]["parameters"]
    assert rd.served("GET", source["path"]), f"the EPP scrapes {source['path']}, not served"
    # Probes on its gRPC health port; grace at least the pool pods'.
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == rd.container_ports(c)["grpc-health"], probe
    grace = replicas["sts"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert epp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= grace
    # RBAC: the pods and the pool.
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    rd.one(pool_docs, "ServiceAccount", account)
    assert role_grants(pool_docs, account, "", "pods") >= {"get", "list", "watch"}
    group = pool["apiVersion"].split("/")[0]
    assert role_grants(pool_docs, account, group, "inferencepools") >= {"get", "list", "watch"}


def test_replicas_export_what_the_endpoint_picker_reads(replicas):
    from server.common.metrics import ServerMetrics

    args = replicas["args"]
    body, _ = ServerMetrics(args.served_model_name[0], names=args.metrics_names,
                            max_loras=args.max_loras if args.enable_lora else 0).render()
    text = body.decode()
    for name in rd.EPP_METRICS:
        assert re.search(rf"^# TYPE {re.escape(name)} (gauge|info)$", text, re.M), (
            f"/metrics of a replica has no {name} (--metrics-names {args.metrics_names})")
    # The same exposition, the other way: without vLLM's names the EPP sees nothing.
    body, _ = ServerMetrics("m", names="pagedserve").render()
    assert "vllm:num_requests_waiting" not in body.decode()


def test_http_route_sends_the_gateway_to_the_pool(pool_docs):
    route = rd.one(pool_docs, "HTTPRoute")
    gateway = rd.one(pool_docs, "Gateway")
    pool = rd.one(pool_docs, "InferencePool")
    (parent,) = route["spec"]["parentRefs"]
    assert (parent.get("group"), parent.get("kind"), parent["name"]) == (
        "gateway.networking.k8s.io", "Gateway", gateway["metadata"]["name"])
    assert any(listener["protocol"] == "HTTP" for listener in gateway["spec"]["listeners"])
    for rule in route["spec"]["rules"]:
        (backend,) = rule["backendRefs"]
        assert (backend["group"], backend["kind"], backend["name"]) == (
            pool["apiVersion"].split("/")[0], "InferencePool", pool["metadata"]["name"])
        assert any(m["path"] == {"type": "PathPrefix", "value": "/"} for m in rule["matches"])


# ------------------------------------------------------------------------------------------
# Compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(rd.COMPOSE_ROUTER.read_text())


def compose_replicas(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items()
            if s.get("image", "").startswith("pagedserve")}


def compose_command(service: dict) -> list[str]:
    command = service.get("command", [])
    command = shlex.split(command) if isinstance(command, str) else command
    return [rd.compose_interpolate(str(c)) for c in command]


def compose_env(service: dict) -> dict[str, str | None]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: None if v is None else rd.compose_interpolate(str(v)) for k, v in env.items()}


def healthcheck_url(service: dict, name: str) -> tuple[int, str]:
    test = service["healthcheck"]["test"]
    assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: healthcheck {test}"
    match = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", " ".join(test[1:]))
    assert match, f"{name}: the healthcheck requests no local URL: {test}"
    return int(match.group(1)), match.group(2)


def test_compose_matches_the_compose_specification(compose):
    errors = compose_spec_errors(compose)
    assert not errors, "\n".join(errors)


def test_compose_services_builds_and_volumes(compose):
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", DOCKERFILE.read_text(), re.M | re.I))
    services = compose["services"]
    assert len(compose_replicas(compose)) >= 2 and "router" in services
    for name, service in services.items():
        build = service["build"]
        context = (rd.COMPOSE_ROUTER.parent / build["context"]).resolve()
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert dockerfile.is_file(), f"{name}: no {dockerfile}"
        if "target" in build:
            assert dockerfile == DOCKERFILE and build["target"] in stages, name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source in (compose.get("volumes") or {}), f"{name}: volume {source} undefined"
        for published in service.get("ports", []):
            assert str(published).startswith("127.0.0.1:"), f"{name}: publish on loopback"
    caches = [v.split(":")[0] for s in compose_replicas(compose).values() for v in s["volumes"]]
    assert len(caches) == len(set(caches)), "each replica its own model cache"
    assert rd.ROUTER_DOCKERFILE == (rd.COMPOSE_ROUTER.parent / services["router"]["build"][
        "context"] / services["router"]["build"]["dockerfile"]).resolve()


def test_compose_replicas(compose):
    for name, service in compose_replicas(compose).items():
        args = parse_serve(compose_command(service), compose_env(service), name)
        port, path = healthcheck_url(service, name)
        assert port == args.port and rd.served("GET", path), f"{name}: healthcheck {path}"
        grace = re.fullmatch(r"(\d+)s", service["stop_grace_period"])
        assert grace and int(grace.group(1)) > args.shutdown_timeout
        assert "ports" not in service, f"{name}: clients go through the router"


def test_compose_router_depends_on_healthy_replicas(compose, router_flags):
    services = compose["services"]
    router = services["router"]
    args = compose_command(router)
    used = {a.split("=")[0] for a in args if a.startswith("--")}
    assert used <= router_flags, f"not in vllm-router --help: {sorted(used - router_flags)}"
    parsed = rd.parse_router_args(args)
    assert parsed.policy == "cache_aware" and parsed.host == "0.0.0.0"
    replicas = compose_replicas(compose)
    workers = {}
    for url in parsed.worker_urls:
        scheme, host, port = rd.host_port(url)
        assert host in replicas, f"{url}: no such service"
        replica_port = parse_serve(compose_command(replicas[host]), compose_env(replicas[host]),
                                   host).port
        assert (scheme, port) == ("http", replica_port), url
        workers[host] = url
    assert workers.keys() == replicas.keys() and len(workers) == len(parsed.worker_urls)
    depends = router["depends_on"]
    assert set(depends) == set(replicas)
    for name, condition in depends.items():
        assert name in services
        assert condition["condition"] == "service_healthy" and "healthcheck" in services[name]
    port, path = healthcheck_url(router, "router")
    assert port == parsed.port and path in ROUTER_PROBE_PATHS
    assert router["ports"] == [f"127.0.0.1:{parsed.port}:{parsed.port}"]


# ------------------------------------------------------------------------------------------
# vllm-router itself, with the files' args


# Paths the router answers itself (GET): checked against the running binary below.
ROUTER_PROBE_PATHS = ("/liveness", "/readiness", "/health")


def exercise(url: str, model: str) -> None:
    import httpx

    headers = {"authorization": "Bearer client-key"}
    for path, body in (("/v1/chat/completions",
                        {"model": model, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2}),
                       ("/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 2})):
        response = httpx.post(url + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 200, (path, response.text)
    for path in ROUTER_PROBE_PATHS:
        assert httpx.get(url + path, timeout=10).status_code == 200, path


def check_worker_requests(workers: list[rd.FakeWorker], api_key: str) -> None:
    requests = [r for w in workers for r in w.requests]
    assert any(path == "/health" for _, path, _ in requests), "no health check reached a worker"
    for method, path, auth in requests:
        assert rd.served(method, path), f"vllm-router asked a worker for {method} {path}"
        if path.endswith("/render"):
            assert auth == f"Bearer {api_key}", f"{path} without the replicas' key: {auth}"
        elif method == "POST":
            assert auth == "Bearer client-key", f"{path}: the client's key is not forwarded"


def test_kv_aware_router_starts_with_the_manifest_args(router_bin):
    import zmq

    args = router_args(rd.KV_AWARE_DIR, {"WORKER_API_KEY": "replica-key"})
    parsed = rd.parse_router_args(args)
    workers = {url: rd.FakeWorker() for url in parsed.worker_urls}
    local, replaced = rd.localize(args, workers)
    context = zmq.Context()
    publishers = []
    try:
        for old, new in replaced.items():
            if old.startswith("tcp://"):
                pub = context.socket(zmq.PUB)
                pub.bind(new)
                publishers.append((old, pub, pub.get_monitor_socket(zmq.EVENT_ACCEPTED)))
        with rd.running_router(router_bin, local) as url:
            for old, _, monitor in publishers:
                assert monitor.poll(15_000), f"the router never connected to {old}"
            exercise(url, parsed.kv_event_model)
    finally:
        for _, pub, monitor in publishers:
            pub.disable_monitor()
            monitor.close(linger=0)
            pub.close(linger=0)
        context.destroy(linger=0)  # term() would wait on any socket left open
        for worker in workers.values():
            worker.close()
    check_worker_requests(list(workers.values()), "replica-key")


def test_compose_router_starts_with_its_command(router_bin, compose):
    router = compose["services"]["router"]
    args = [rd.compose_interpolate(str(a), {"PAGEDSERVE_API_KEY": "replica-key"})
            for a in router["command"]]
    parsed = rd.parse_router_args(args)
    workers = {url: rd.FakeWorker() for url in parsed.worker_urls}
    local, _ = rd.localize(args, workers)
    try:
        with rd.running_router(router_bin, local) as url:
            import httpx

            _, path = healthcheck_url(router, "router")
            assert httpx.get(url + path, timeout=10).status_code == 200
            exercise(url, "SmolLM2-135M-Instruct")
    finally:
        for worker in workers.values():
            worker.close()
    check_worker_requests(list(workers.values()), "replica-key")


def test_router_rejects_a_source_that_is_no_worker(router_bin):
    """The live check can fail: a --kv-event-source for a URL not in --worker-urls stops
    the router."""
    args = router_args(rd.KV_AWARE_DIR)
    i = args.index("--kv-event-source") + 1
    args[i] = args[i].replace("-0.", "-9.", 1)
    parsed = rd.parse_router_args(args)
    workers = {url: rd.FakeWorker() for url in parsed.worker_urls}
    local, _ = rd.localize(args, workers)
    try:
        with pytest.raises(AssertionError, match="is not in --worker-urls"):
            with rd.running_router(router_bin, local, timeout=30):
                pass
    finally:
        for worker in workers.values():
            worker.close()


# ------------------------------------------------------------------------------------------
# the router image and the docs


def test_router_dockerfile():
    text = rd.ROUTER_DOCKERFILE.read_text()
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent))
    if hadolint:
        result = subprocess.run([hadolint, "--no-color", str(rd.ROUTER_DOCKERFILE)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r'^ENTRYPOINT \["vllm-router"\]$', text, re.M)
    assert re.search(r'pip install .*"vllm-router==\$\{VLLM_ROUTER_VERSION\}"', text)
    user = re.findall(r"^USER (\d+)", text, re.M)
    assert user and int(user[-1]) != 0, "runs as root"
    ports = re.search(r"^EXPOSE (.+)$", text, re.M).group(1).split()
    args = router_args(rd.ROUTER_DIR)
    assert sorted(ports) == sorted([rd.flag_value(args, "--port"),
                                    rd.flag_value(args, "--prometheus-port")])


def test_docs_say_how_to_apply_each():
    text = DOCS.read_text()
    section = text[text.index("## Several replicas behind a router"):]
    for directory in (rd.ROUTER_DIR, rd.KV_AWARE_DIR, rd.POOL_DIR):
        command = f"kubectl apply -n pagedserve -k {directory.relative_to(ROOT)}"
        assert command in section, f"docs/deploy.md does not show `{command}`"
    assert f"docker compose -f {rd.COMPOSE_ROUTER.relative_to(ROOT)} up" in section
    for metric in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:lora_requests_info"):
        assert metric in section


def test_fake_worker_and_localize_round_trip():
    """The helpers the live tests rely on: every worker URL and endpoint is replaced."""
    worker = rd.FakeWorker()
    try:
        args = ["--host", "0.0.0.0", "--port", "8000", "--worker-urls", "http://a:8000",
                "--kv-event-source", "http://a:8000=tcp://a:5557"]
        local, replaced = rd.localize(args, {"http://a:8000": worker})
        assert "http://a:8000" not in " ".join(local) and "tcp://a" not in " ".join(local)
        assert local[local.index("--kv-event-source") + 1].startswith(worker.url + "=tcp://")
        import httpx

        assert httpx.get(worker.url + "/health", timeout=5).status_code == 200
        assert worker.requests == [("GET", "/health", None)]
        assert len(replaced) == 2
    finally:
        worker.close()
