"""deploy/compose/chat-and-embeddings.yaml and its nginx config: a chat server and an
embedder in one --cpu-turns group behind one port. Checked without a Docker engine: the
Compose Specification schema; both servers' flags as `pagedserve serve` parses them (the
same group, the chat server its foreground, the embedder in the background with steps that
hold its model's inputs); the embedder sharing the chat server's IPC namespace (and so its
/dev/shm, where the group's lock is); nginx sending every pooling route the server registers
to the embedder and the rest to the chat server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from server.http.cli import make_arg_parser
from tests.support.kubernetes_schemas import compose_spec_errors
from tests.support.router_deploy import compose_interpolate

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose" / "chat-and-embeddings.yaml"
NGINX = ROOT / "deploy" / "compose" / "chat-and-embeddings.nginx.conf"
ENV = {"EMBEDDING_MODEL_DIR": "/srv/all-MiniLM-L6-v2"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def serve_args(service: dict):
    return make_arg_parser().parse_args(
        [compose_interpolate(str(token), ENV) for token in service["command"]])


def test_compose_matches_the_compose_specification(compose):
    errors = compose_spec_errors(compose)
    assert not errors, "\n".join(errors)


def test_both_servers_take_turns_in_one_group(compose):
    services = compose["services"]
    chat, embedder = serve_args(services["chat"]), serve_args(services["embedder"])
    assert chat.cpu_turns == embedder.cpu_turns is not None
    assert chat.cpu_turns_share is None and 0 < embedder.cpu_turns_share < 1
    # all-MiniLM-L6-v2 reads up to 256 tokens: a whole input fits one background step.
    assert embedder.max_num_batched_tokens >= 256
    assert embedder.model == "/embedder"
    volume = services["embedder"]["volumes"][0]
    assert compose_interpolate(volume, ENV) == f"{ENV['EMBEDDING_MODEL_DIR']}:/embedder:ro"
    with pytest.raises(ValueError, match="EMBEDDING_MODEL_DIR"):  # compose refuses to start
        compose_interpolate(volume, {})
    # The lock lives in /dev/shm: the embedder joins the chat server's IPC namespace.
    assert services["chat"]["ipc"] == "shareable"
    assert services["embedder"]["ipc"] == "service:chat"
    ports = services["proxy"]["ports"]
    assert ports == ["127.0.0.1:8000:8000"] and "ports" not in services["chat"]


def test_nginx_routes_pooling_to_the_embedder_and_the_rest_to_chat():
    locations = {}
    for regex, prefix, body in re.findall(r"location\s+(?:~\s+(\S+)|(/))\s*\{([^}]*)\}",
                                          NGINX.read_text()):
        (upstream,) = re.findall(r"proxy_pass\s+http://(\w+):8000;", body)
        locations[regex or prefix] = upstream
    (pooling_regex,) = [key for key in locations if key != "/"]
    assert locations == {pooling_regex: "embedder", "/": "chat"}
    pooling = re.compile(pooling_regex)
    # Every path the pooling routes register (server/apis/embeddings/routes.py).
    source = (ROOT / "server" / "apis" / "embeddings" / "routes.py").read_text()
    pooling_paths = set(re.findall(r'"(/[\w/]+)"', source))
    assert {"/v1/embeddings", "/api/embed", "/v1/rerank", "/v2/rerank", "/v1/score"} <= \
        pooling_paths
    for path in pooling_paths:
        assert pooling.search(path), f"nginx sends {path} to the chat server"
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/api/chat",
                 "/v1/responses", "/v1/messages", "/metrics", "/health"):
        assert not pooling.search(path), f"nginx sends {path} to the embedder"
