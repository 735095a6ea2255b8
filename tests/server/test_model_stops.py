"""A model whose generation_config.json lists two EOS ids stops at the second one both
offline (`LLM`) and served (the CLI's flags, `APIServer`, a real HTTP request): both load
the model through engine/model_loader/resources.py.

The tiny random Llama's greedy output is read first under its own generation config (one
EOS id); a token it produces part-way is then made the second EOS id.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerThread

MAX_TOKENS = 24
PROMPT = [5, 17, 42, 99, 123, 7, 64]


@pytest.fixture(scope="module")
def two_eos_model(tmp_path_factory):
    """(checkpoint dir, the free greedy output, the index of the second EOS id in it)."""
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("two-eos"), "llama")
    with LLM(model_dir, dtype="float32", max_model_len=128) as llm:
        eos = llm.resources.eos_token_id
        assert llm.resources.extra_stop_token_ids == []
        free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)[0].outputs[0].token_ids
    assert len(free) == MAX_TOKENS, "the random model ended early on its own EOS"
    # The first token past the second position that the output has not produced before.
    stop_at = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i] and t != eos)
    assert stop_at < MAX_TOKENS - 1
    config_path = model_dir / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [eos, free[stop_at]]
    config_path.write_text(json.dumps(config))
    return model_dir, list(free), stop_at


def test_llm_and_server_stop_at_the_second_eos(two_eos_model):
    model_dir, free, stop_at = two_eos_model
    second_eos = free[stop_at]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(model_dir, dtype="float32", max_model_len=128) as llm:
        assert llm.resources.extra_stop_token_ids == [second_eos]
        offline = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert offline.token_ids == free[:stop_at + 1]  # stopped there, not at max_tokens
    assert (offline.finish_reason, offline.stop_reason) == ("stop", second_eos)

    from server.http.api_server import APIServer, ServeOptions
    from server.http.cli import engine_config_from_args, make_arg_parser

    args = make_arg_parser().parse_args(
        ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "128",
         "--port", "0", "--log-level", "warning"])
    options = ServeOptions.from_options(vars(args), engine_mode="thread")
    server = ServerThread(APIServer(options, engine_config_from_args(args, args.model, "tiny"),
                                    args.model, ["tiny"])).start()
    try:
        assert server.server.state.extra_stop_token_ids == [second_eos]
        body = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        }).json()
    finally:
        server.stop()
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (offline.text, "stop")
    assert body["usage"]["completion_tokens"] == stop_at + 1 < MAX_TOKENS
