"""Routers people run in front of vLLM route pagedserve unchanged (issue 43, item 1).

vllm-router (PyPI `vllm-router`, its Rust binary) with the cache_aware policy in front of
two real replicas of a tiny model: it adds SGLang's and vLLM's extras to every body it
forwards (no_stop_trim, separate_reasoning, stream_reasoning, return_hidden_states,
continue_final_message, include_reasoning) and tokenizes chats through /tokenize. Those
fields at their defaults are accepted; a value that asks for something this server does
not do is a 400 naming the field; an unknown field is still a 400.

vllm-router's kv_aware policy reads the replicas' KV events (--kv-events-config, vLLM's
wire format; item 2): a prompt whose prefix one replica computed is routed to that one.
"""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.router_fixtures import needs_router, running_router
from tests.support.server_fixtures import ServerProcess, free_port, serving


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("router"), "llama")


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Two replicas, each publishing its KV events on its own two ports."""
    with contextlib.ExitStack() as stack:
        started = []
        for _ in range(2):
            events = {"enable_kv_cache_events": True, "publisher": "zmq",
                      "endpoint": f"tcp://127.0.0.1:{free_port()}",
                      "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
            args = ["--model", str(model_dir), "--served-model-name", "tiny", "--port", "0",
                    "--kv-cache-memory", "32M", "--max-model-len", "256", "--dtype", "float32",
                    "--block-size", "16", "--kv-events-config", json.dumps(events)]
            replica = stack.enter_context(serving(ServerProcess(args, env={})))
            replica.events = events
            started.append(replica)
        yield started




@pytest.fixture(scope="module")
def router(replicas):
    with running_router(replicas, "cache_aware") as url:
        yield url


def served_requests(replica) -> int:
    """Generations the replica answered (its access log), renders aside."""
    return sum(1 for line in replica.lines if '"POST /v1/' in line and '" 200 ' in line
               and "/render " not in line)


def rendered_chats(replica) -> int:
    return sum(1 for line in replica.lines
               if '"POST /v1/chat/completions/render ' in line and '" 200 ' in line)


@needs_router
def test_chat_and_completions_through_vllm_router(router, replicas):
    before = [served_requests(r) for r in replicas]
    renders_before = sum(rendered_chats(r) for r in replicas)
    for i in range(4):
        chat = httpx.post(router + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": f"hello {i}"}],
            "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["completion_tokens"] >= 1
        completion = httpx.post(router + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": f"count {i}", "max_tokens": 4, "temperature": 0})
        assert completion.status_code == 200, completion.text
    with httpx.stream("POST", router + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": "stream"}],
            "max_tokens": 4, "temperature": 0, "stream": True}) as stream:
        assert stream.status_code == 200
        assert "data: [DONE]" in "".join(stream.iter_text())
    # The access-log line of the streamed request may come a moment after its last byte.
    deadline = time.monotonic() + 10
    while (served := sum(served_requests(r) for r in replicas) - sum(before)) < 9 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert served == 9  # every request reached a replica once
    # cache_aware tokenized the chats through vLLM's render endpoint (not /tokenize).
    assert sum(rendered_chats(r) for r in replicas) - renders_before >= 5


@needs_router
def test_kv_aware_routes_by_the_replicas_kv_events(replicas):
    """A prefix computed on one replica (sent to it directly, past the router) is known
    to the router only from that replica's BlockStored events; kv_aware sends the next
    prompt with that prefix there, whichever replica it is."""
    sources = []
    for replica in replicas:
        sources += ["--kv-event-source", f"{replica.url}={replica.events['endpoint']}",
                    "--kv-event-replay-source",
                    f"{replica.url}={replica.events['replay_endpoint']}"]
    with running_router(replicas, "kv_aware", "--kv-event-block-size", "16",
                        "--kv-event-model", "tiny", *sources) as url:
        for holder in (1, 0):  # 1 first: with no events the router's tie goes to 0
            prefix = f"tenant{holder} " + " ".join(f"word{i}" for i in range(12))
            warm = direct(replicas[holder], "/v1/completions", prompt=prefix + " one")
            assert warm.status_code == 200, warm.text
            time.sleep(1.0)  # the events reach the router over loopback ZeroMQ
            before = [served_requests(r) for r in replicas]
            routed = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prefix + " two", "max_tokens": 2,
                "temperature": 0})
            assert routed.status_code == 200, routed.text
            deadline = time.monotonic() + 10  # the access-log line may come a moment late
            while sum(served_requests(r) for r in replicas) == sum(before) \
                    and time.monotonic() < deadline:
                time.sleep(0.1)
            went = [served_requests(r) - b for r, b in zip(replicas, before, strict=True)]
            assert went == [int(i == holder) for i in range(2)], went
            assert routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16


def direct(replica, path: str, **fields) -> httpx.Response:
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, **fields}
    return httpx.post(replica.url + path, json=body, timeout=60)


def test_other_dialects_fields_at_their_defaults_are_accepted(replicas):
    router_fields = {"no_stop_trim": False, "separate_reasoning": True, "stream_reasoning": True,
                     "return_hidden_states": False, "continue_final_message": False,
                     "include_reasoning": True, "logprobs": False, "ignore_eos": False,
                     "skip_special_tokens": True}
    chat = direct(replicas[0], "/v1/chat/completions",
                  messages=[{"role": "user", "content": "hi"}], **router_fields)
    assert chat.status_code == 200, chat.text
    completion = direct(replicas[0], "/v1/completions", prompt="hi", no_stop_trim=False,
                        return_hidden_states=False, echo=False)
    assert completion.status_code == 200, completion.text
    tokenize = httpx.post(replicas[0].url + "/tokenize", timeout=60, json={
        "model": "tiny", "continue_final_message": False,
        "messages": [{"role": "user", "content": "hi"}]})
    assert tokenize.status_code == 200, tokenize.text


@pytest.mark.parametrize("field,value", [("return_hidden_states", True),
                                         ("include_reasoning", False),
                                         ("no_such_field", 1)])
def test_what_this_server_does_not_do_is_a_400_naming_the_field(replicas, field, value):
    response = direct(replicas[0], "/v1/chat/completions",
                      messages=[{"role": "user", "content": "hi"}], **{field: value})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


def test_no_stop_trim_keeps_the_stop_string(replicas):
    """SGLang's no_stop_trim is vLLM's include_stop_str_in_output."""
    free = direct(replicas[0], "/v1/completions", prompt="a b c", max_tokens=12).json()
    text = free["choices"][0]["text"]
    if len(text.strip()) < 2:
        pytest.skip("the random model's greedy text is too short to hold a stop string")
    stop = text.strip()[1]
    trimmed = direct(replicas[0], "/v1/completions", prompt="a b c", max_tokens=12,
                     stop=[stop]).json()["choices"][0]["text"]
    kept = direct(replicas[0], "/v1/completions", prompt="a b c", max_tokens=12, stop=[stop],
                  no_stop_trim=True).json()["choices"][0]["text"]
    assert kept == trimmed + stop
