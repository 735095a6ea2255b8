"""Sampling defaults (engine/sampling_defaults.py): which value an unset field takes, and
the errors a server owner gets for settings that cannot work."""

from __future__ import annotations

import argparse
import json
import logging
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig, ModelConfig, generation_config_source
from engine.model_loader.gguf import gguf_sampling_defaults
from engine.sampling_defaults import OLLAMA_DEFAULTS, SamplingDefaults, resolve_sampling_defaults
from server.chat.sampling import build_sampling_params, check_prompts
from server.common.lifecycle import ServerLimits
from server.common.protocol import ChatCompletionRequest

LLAMA_31 = {"bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128009],
            "temperature": 0.6, "top_p": 0.9}


def test_the_module_docs_worked_example():
    defaults = resolve_sampling_defaults("auto", LLAMA_31, {"temperature": 0.2}, 512)
    assert defaults.fields == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512}
    assert defaults.sources == {"temperature": "--override-generation-config",
                                "top_p": "the model's generation_config.json",
                                "max_tokens": "--max-tokens-default"}
    assert "temperature 0.2 (--override-generation-config)" in defaults.describe()


def test_generation_config_names_map_to_request_names():
    config = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.05,
              "repetition_penalty": 1.05, "max_new_tokens": 300, "do_sample": True}
    assert resolve_sampling_defaults("auto", config).fields == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05,
        "repetition_penalty": 1.05, "max_tokens": 300}


def test_vllm_mode_ignores_the_model_but_not_the_owner():
    assert resolve_sampling_defaults("vllm", LLAMA_31).fields == {}
    assert resolve_sampling_defaults("vllm", LLAMA_31, {"top_k": 5}).fields == {"top_k": 5}


def test_a_folder_replaces_the_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    defaults = resolve_sampling_defaults(str(tmp_path), LLAMA_31)
    assert defaults.fields == {"temperature": 0.3}
    assert defaults.sources["temperature"] == str(tmp_path / "generation_config.json")


def test_the_flags_parser_checks_the_folder(tmp_path):
    assert generation_config_source("auto") == "auto"
    with pytest.raises(argparse.ArgumentTypeError, match="generation_config.json"):
        generation_config_source(str(tmp_path))  # no file in it
    with pytest.raises(argparse.ArgumentTypeError):
        EngineConfig.from_options("/m", generation_config=str(tmp_path / "missing"))


def test_owner_mistakes_are_refused_at_start_up():
    with pytest.raises(ValueError, match="unknown key.*temprature"):
        ModelConfig("/m", override_generation_config={"temprature": 0.5})
    with pytest.raises(ValueError, match="top_p"):
        ModelConfig("/m", override_generation_config={"top_p": 0})
    with pytest.raises(ValueError, match="keep one"):
        ModelConfig("/m", override_generation_config={"max_new_tokens": 10},
                    max_tokens_default=20)
    with pytest.raises(ValueError, match="must be a number"):
        ModelConfig("/m", override_generation_config={"temperature": "hot"})


def test_a_models_bad_value_is_left_out_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        defaults = resolve_sampling_defaults("auto", {"temperature": -1, "top_k": 40})
    assert defaults.fields == {"top_k": 40}
    assert "temperature" in caplog.text


def test_a_ggufs_sampling_keys_become_generation_config_names():
    gguf = SimpleNamespace(get={"general.sampling.temp": 0.6, "general.sampling.top_k": 20,
                                "general.sampling.penalty_repeat": 1.1}.get)
    config = gguf_sampling_defaults(gguf)
    assert config == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    assert resolve_sampling_defaults("auto", config).fields == {
        "temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}


# ------------------------------------------------------------ a request's fields


def state_with(defaults: SamplingDefaults, max_model_len: int = 100):
    engine = SimpleNamespace(max_model_len=max_model_len, vocab_size=1000)
    return SimpleNamespace(sampling_defaults=defaults, limits=ServerLimits(),
                           extra_stop_token_ids=[], engine=engine)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_request_then_server_then_api_then_neutral():
    server = SamplingDefaults({"temperature": 0.2, "max_tokens": 50},
                              {"temperature": "x", "max_tokens": "x"})
    state = state_with(server)
    params = build_sampling_params(state, request(top_p=0.5), logprobs=None,
                                   api_defaults=OLLAMA_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (0.2, 0.5, 40, 50)  # server, request, Ollama's own, server
    params = build_sampling_params(state, request(temperature=1.3, max_tokens=7), logprobs=None)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == \
        (1.3, 1.0, 0, 7)
    neutral = build_sampling_params(state_with(SamplingDefaults()), request(), logprobs=None)
    assert (neutral.temperature, neutral.top_p, neutral.top_k, neutral.min_p,
            neutral.repetition_penalty, neutral.max_tokens) == (1.0, 1.0, 0, 0.0, 1.0, None)


def test_a_default_cap_shrinks_to_the_room_a_long_prompt_leaves():
    state = state_with(SamplingDefaults({"max_tokens": 50}, {"max_tokens": "x"}),
                       max_model_len=100)
    body = request()
    params = build_sampling_params(state, body, logprobs=None)
    check_prompts(state, [list(range(80))], params, body)
    assert params.max_tokens == 20  # not a 400: the cap is the server's, not the client's
    explicit = request(max_tokens=50)
    params = build_sampling_params(state, explicit, logprobs=None)
    with pytest.raises(Exception, match="you requested 130 tokens"):  # the client's own: refused
        check_prompts(state, [list(range(80))], params, explicit)
