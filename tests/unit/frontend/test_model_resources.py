"""engine/model_loader/resources.py: the one loader of a model's tokenizer, EOS ids and
generation config (the server, LLM and the engine core's grammar compiler use it)."""

from __future__ import annotations

import json

import pytest

from engine.model_loader.resources import (
    ModelResources,
    eos_token_ids,
    load_model_resources,
    load_tokenizer,
)
from engine.sampling_params import SamplingParams
from tests.support.server_fixtures import build_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize(("config", "tokenizer_eos", "expected"), [
    ({}, 2, [2]),
    ({}, None, []),
    ({"eos_token_id": 7}, 2, [2, 7]),
    ({"eos_token_id": [128001, 128008, 128009]}, 128009, [128001, 128008, 128009]),  # Llama 3.1
    ({"eos_token_id": [1, 106]}, 1, [1, 106]),  # Gemma
    ({"eos_token_id": None}, 2, [2]),
])
def test_eos_ids_the_engines_first(config, tokenizer_eos, expected):
    assert eos_token_ids(config, tokenizer_eos) == expected


def test_load_with_and_without_a_generation_config(tmp_path, tokenizer_dir):
    resources = load_model_resources(tokenizer_dir)  # a tokenizer-only dir: used as it is
    eos = resources.tokenizer.eos_token_id
    assert (resources.eos_token_id, resources.extra_stop_token_ids) == (eos, [])
    assert resources.generation_config == {} and resources.chat_template
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    for path in tokenizer_dir.iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [eos, 5, 6], "temperature": 0.6}))
    resources = load_model_resources(model_dir)
    assert (resources.eos_token_id, resources.extra_stop_token_ids) == (eos, [5, 6])
    assert resources.generation_config["temperature"] == 0.6
    assert len(load_tokenizer(model_dir)) == len(resources.tokenizer)  # the core's loader


def test_model_stops_join_the_request_stops():
    resources = ModelResources(tokenizer=None, eos_token_id=2, extra_stop_token_ids=[5, 6])
    params = SamplingParams(stop_token_ids=[6, 9])
    joined = resources.with_model_stops(params)
    assert joined.stop_token_ids == [6, 9, 5] and params.stop_token_ids == [6, 9]
    ignoring = SamplingParams(ignore_eos=True)
    assert resources.with_model_stops(ignoring).stop_token_ids == []
