"""KV-cache events over ZeroMQ, read by a subscriber written from vLLM's documented
format (pyzmq + msgspec, its examples/online_serving/kv_events_subscriber.py, the
structs of vLLM 0.28's distributed/kv_events.py): a real
server with --kv-events-config publishes AllBlocksCleared at start, then BlockStored
with a prompt's full blocks and tokens; the replay socket resends from any sequence
number and ends with the -1 marker."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import zmq

from tests.support.kv_event_wire import DECODER, AllBlocksCleared, BlockStored, replay_from
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerThread, free_port

BLOCK_SIZE = 16




@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server.http.api_server import APIServer, ServeOptions
    from server.http.cli import engine_config_from_args, make_arg_parser

    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("events"), "llama")
    pub, replay = free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
              "topic": "kv-events"}
    args = make_arg_parser().parse_args(
        ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "256",
         "--block-size", str(BLOCK_SIZE), "--kv-events-config", json.dumps(events),
         "--port", "0", "--log-level", "warning"])
    options = ServeOptions.from_options(vars(args), engine_mode="thread")
    thread = ServerThread(APIServer(options, engine_config_from_args(args, args.model, "tiny"),
                                    args.model, ["tiny"])).start()
    thread.endpoints = events
    yield thread
    thread.stop()


def test_prompts_blocks_are_published_and_replayed(server):
    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.connect(server.endpoints["endpoint"])
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        time.sleep(0.5)  # a SUB socket sees only what is sent after it joined
        prompt = list(range(10, 10 + 2 * BLOCK_SIZE + 5))  # two full blocks and 5 more
        body = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}).json()
        assert body["usage"]["prompt_tokens"] == len(prompt)
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 30
        while sum(len(e.token_ids) for e in stored) < 2 * BLOCK_SIZE:
            assert time.monotonic() < deadline, "no BlockStored for the prompt"
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv-events" and len(seq) == 8
                stored += [e for e in DECODER.decode(payload).events
                           if isinstance(e, BlockStored)]
        first = stored[0]
        assert first.parent_block_hash is None and first.block_size == BLOCK_SIZE
        tokens = [t for e in stored for t in e.token_ids]
        assert tokens[:2 * BLOCK_SIZE] == prompt[:2 * BLOCK_SIZE]
        hashes = [h for e in stored for h in e.block_hashes]
        # vLLM's default wire hash: the digest's last 8 bytes as an unsigned integer.
        assert len(set(hashes)) == len(hashes) and all(0 <= h < 2**64 for h in hashes)
        assert first.medium == "GPU" and first.group_idx == 0 and first.lora_name is None

        # Replay from the start: message 0 is the start-up AllBlocksCleared.
        replayed = replay_from(context, server.endpoints["replay_endpoint"], 0)
        assert all(batch.data_parallel_rank == 0 for _, batch in replayed)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert replayed[0][1].events == [AllBlocksCleared()]
        replayed_hashes = [h for _, batch in replayed for e in batch.events
                           if isinstance(e, BlockStored) for h in e.block_hashes]
        assert hashes == replayed_hashes[:len(hashes)]
    finally:
        context.destroy(linger=0)
