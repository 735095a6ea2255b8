"""Sampling defaults a server owner sets reach every API, and /v1/models shows them.

A tiny random Llama whose generation_config.json says max_new_tokens 5 and temperature
1.5, served with --override-generation-config '{"temperature": 0}': requests that set
neither field decode greedily (the owner's 0 beats the model's 1.5 and Ollama's own 0.8)
and stop after 5 tokens; a request's own values still win. The offline LLM takes the
same defaults.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine.frontend.llm import LLM
from engine.sampling_params import SamplingParams
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.server_fixtures import ServerThread

PROMPT = [5, 17, 42, 99, 123, 7, 64]
OVERRIDE = '{"temperature": 0}'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp("defaults"), "llama")
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "max_new_tokens": 5,
                                "temperature": 1.5}))
    return model_dir


@pytest.fixture(scope="module")
def server(model_dir):
    from server.http.api_server import APIServer, ServeOptions
    from server.http.cli import engine_config_from_args, make_arg_parser

    args = make_arg_parser().parse_args(
        ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "128",
         "--override-generation-config", OVERRIDE, "--port", "0", "--log-level", "warning"])
    options = ServeOptions.from_options(vars(args), engine_mode="thread")
    thread = ServerThread(APIServer(options, engine_config_from_args(args, args.model, "tiny"),
                                    args.model, ["tiny"])).start()
    yield thread
    thread.stop()


def complete(server, **fields) -> dict:
    response = httpx.post(server.url + "/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": PROMPT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_defaults_in_force(server):
    card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert card["sampling_defaults"] == {"temperature": 0.0, "max_tokens": 5}


def test_unset_fields_take_the_defaults_and_set_ones_win(server):
    greedy = complete(server, temperature=0.0, max_tokens=5)
    unset = complete(server)
    assert unset["usage"]["completion_tokens"] == 5
    assert unset["choices"][0]["finish_reason"] == "length"
    assert unset["choices"][0]["text"] == greedy["choices"][0]["text"]
    longer = complete(server, max_tokens=9, temperature=0.0)
    assert longer["usage"]["completion_tokens"] == 9
    # The request's own temperature: 20 seeds at 1.5 do not all give the greedy text.
    texts = {complete(server, temperature=1.5, seed=s)["choices"][0]["text"] for s in range(20)}
    assert texts != {greedy["choices"][0]["text"]}


def test_ollama_takes_the_servers_defaults_over_its_own(server):
    def generate(options=None) -> dict:
        body = {"model": "tiny", "prompt": "hello there", "stream": False}
        if options is not None:
            body["options"] = options
        response = httpx.post(server.url + "/api/generate", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    unset = generate()
    assert unset["eval_count"] == 5 and unset["done_reason"] == "length"
    assert unset["response"] == generate({"temperature": 0, "num_predict": 5})["response"]


def test_llm_uses_the_same_defaults(model_dir):
    with LLM(model_dir, dtype="float32", max_model_len=128,
             override_generation_config=OVERRIDE) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
        out = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
        greedy = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5),
                              use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids and len(out.token_ids) == 5
