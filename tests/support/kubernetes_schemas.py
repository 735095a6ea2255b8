"""Kubernetes manifests against the schemas: built-in kinds through `kubernetes-validate`
(strict), custom resources against the CRD schemas in tests/data/schemas/
(`{kind}.{group}_{version}.json`, lower-case kind); and compose files against the Compose
Specification's (`compose_spec_errors`). Shared by tests/deploy/test_deploy.py,
test_router_deploy.py, test_tensor_parallel_deploy.py and test_compose_chat_and_embeddings.py."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path

import jsonschema
import pytest

SCHEMAS = Path(__file__).resolve().parents[1] / "data" / "schemas"
OLDEST_VERSION = "1.28.0"  # the oldest Kubernetes release the manifests are checked against


def kubernetes_versions() -> set[str]:
    """The newest release kubernetes-validate knows, and OLDEST_VERSION where it knows it."""
    import kubernetes_validate

    latest = kubernetes_validate.utils.latest_version()
    known = kubernetes_validate.utils.all_versions()
    return {latest, OLDEST_VERSION if OLDEST_VERSION in known else latest}


def assert_valid_kubernetes(doc: dict, label: str, versions: set[str] | None = None) -> None:
    """Fails the test, naming `label`, where `doc` is not valid in every release of
    `versions` (default: kubernetes_versions())."""
    import kubernetes_validate

    for version in sorted(versions or kubernetes_versions()):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except jsonschema.ValidationError as exc:
            pytest.fail(f"{label} against Kubernetes {version}: {exc.message}")


def crd_validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    """The validator of the CRD schema for `kind` in `api_version` ("group/version")."""
    group, version = api_version.split("/")
    schema = json.loads((SCHEMAS / f"{kind.lower()}.{group}_{version}.json").read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def compose_spec_errors(doc: dict) -> list[str]:
    """Where a compose file (parsed) breaks the Compose Specification's JSON schema (the copy
    check-jsonschema vendors), one line each; empty when it conforms."""
    schema_file = importlib.resources.files(
        "check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    schema = json.loads(schema_file.read_text())
    errors = jsonschema.validators.validator_for(schema)(schema).iter_errors(doc)
    return [f"{list(e.path)}: {e.message}" for e in sorted(errors, key=lambda e: list(e.path))]
