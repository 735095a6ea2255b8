"""Static checks of the tensor-parallel Kubernetes examples (deploy/kubernetes/tensor-parallel/).

* deployment-tp2.yaml: strict against the Kubernetes schemas; the GPUs of the pod equal
  --tensor-parallel-size; /dev/shm is a memory-backed volume; its flags parse.
* leaderworkerset.yaml: the LeaderWorkerSet against tests/data/schemas (written from the
  LWS API reference), both pod templates strict as Pods, the Service strict; each pod's
  flags, with the LWS variables filled in as LWS would, parse and agree (nnodes = group
  size, GPUs per pod x nodes = TP size, ports = --master-port and the control port).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import jsonschema
import yaml

from engine.config import ParallelConfig
from engine.executor.multiproc_executor import control_port, node_ranks
from server.http.cli import make_arg_parser
from tests.support.kubernetes_schemas import assert_valid_kubernetes

ROOT = Path(__file__).resolve().parents[2]
TP_DIR = ROOT / "deploy" / "kubernetes" / "tensor-parallel"
LWS_SCHEMA = ROOT / "tests" / "data" / "schemas" / "leaderworkerset.x-k8s.io_v1.json"


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((TP_DIR / name).read_text()) if d]


def validate_k8s(doc: dict) -> None:
    import kubernetes_validate

    assert_valid_kubernetes(doc, f"{doc['kind']} {doc['metadata'].get('name')}",
                            {kubernetes_validate.utils.latest_version()})


def parse_serve_args(args: list[str], env: dict[str, str]):
    """The container's args as `pagedserve serve` parses them, $(VAR) expanded like the
    kubelet does."""
    expanded = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        assert "$(" not in arg, f"unexpanded variable in {arg!r}"
        expanded.append(arg)
    return make_arg_parser().parse_args(expanded), shlex.join(expanded)


def check_dev_shm(pod_spec: dict) -> None:
    container = pod_spec["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in pod_spec["volumes"] if v["name"] == mounts["/dev/shm"])
    assert volume["emptyDir"]["medium"] == "Memory"


def test_multi_gpu_deployment():
    (deployment,) = documents("deployment-tp2.yaml")
    validate_k8s(deployment)
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args, _ = parse_serve_args(container["args"], {})
    assert args.tensor_parallel_size == 2 and args.nnodes == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == args.tensor_parallel_size
    assert container["resources"]["requests"]["nvidia.com/gpu"] == args.tensor_parallel_size
    check_dev_shm(pod)
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # Same name and labels as the single-GPU Deployment, so it replaces it.
    (base,) = [d for d in yaml.safe_load_all((TP_DIR.parent / "deployment.yaml").read_text())]
    assert deployment["metadata"]["name"] == base["metadata"]["name"]
    assert deployment["spec"]["selector"] == base["spec"]["selector"]


def test_leader_worker_set():
    docs = {d["kind"]: d for d in documents("leaderworkerset.yaml")}
    lws, service = docs["LeaderWorkerSet"], docs["Service"]
    schema = json.loads(LWS_SCHEMA.read_text())
    errors = [f"{list(e.path)}: {e.message}"
              for e in jsonschema.Draft202012Validator(schema).iter_errors(lws)]
    assert not errors, "\n".join(errors)
    validate_k8s(service)

    group = lws["spec"]["leaderWorkerTemplate"]
    size = group["size"]
    templates = {0: group["leaderTemplate"], 1: group["workerTemplate"]}
    parsed = {}
    for index, template in templates.items():
        validate_k8s({"apiVersion": "v1", "kind": "Pod",
                      "metadata": {"name": f"pod-{index}", **template.get("metadata", {})},
                      "spec": template["spec"]})
        check_dev_shm(template["spec"])
        container = template["spec"]["containers"][0]
        env = {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index),
               "LWS_LEADER_ADDRESS": "pagedserve-tp-0.pagedserve-tp.pagedserve"}
        args, line = parse_serve_args(container["args"], env)
        parsed[index] = args
        assert args.nnodes == size and args.node_rank == index, line
        parallel = ParallelConfig(args.tensor_parallel_size, args.nnodes, args.node_rank,
                                  args.master_addr, args.master_port)
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert len(node_ranks(parallel, index)) == gpus, line
    leader, worker = parsed[0], parsed[1]
    assert vars(leader) | {"node_rank": 0} == vars(worker) | {"node_rank": 0}
    ports = {p["name"]: p["containerPort"]
             for p in templates[0]["spec"]["containers"][0]["ports"]}
    parallel = ParallelConfig(leader.tensor_parallel_size, leader.nnodes, 0,
                              leader.master_addr, leader.master_port)
    assert ports["dist-store"] == leader.master_port
    assert ports["dist-control"] == control_port(parallel)
    assert ports["http"] == 8000
    # The Service selects the leaders only.
    leader_labels = templates[0]["metadata"]["labels"]
    worker_labels = templates[1]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    assert all(leader_labels.get(k) == v for k, v in selector.items())
    assert not all(worker_labels.get(k) == v for k, v in selector.items())


def test_lws_schema_rejects_mistakes():
    schema = json.loads(LWS_SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    lws = next(d for d in documents("leaderworkerset.yaml") if d["kind"] == "LeaderWorkerSet")
    assert validator.is_valid(lws)
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    assert not validator.is_valid(bad)
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    assert not validator.is_valid(bad)
