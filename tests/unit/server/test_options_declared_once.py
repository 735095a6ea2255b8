"""Each option is declared once (engine/config.py `option`), and the three places that
offer it agree on its name and default: the `serve` flags (server/http/cli.py), the config
dataclasses (EngineConfig's parts, ServeOptions, ServerLimits) and `LLM`'s keywords."""

from __future__ import annotations

import argparse
import inspect

import pytest

from engine.config import (
    EngineConfig,
    ModelConfig,
    byte_size,
    cpu_turns_name,
    engine_options,
    fraction,
    generation_config_source,
    hf_overrides_json,
    json_object,
    kv_events_config_json,
    open_fraction,
    positive_int,
    speculative_config_json,
)
from engine.frontend.llm import LLM
from server.http.api_server import ServeOptions, serve_options
from server.http.cli import cli_options, engine_config_from_args, env_name, make_arg_parser

# The flags that name the model itself: resolved before any config is built.
MODEL_SOURCE_DESTS = {"help", "model_tag", "model", "served_model_name"}

# A command-line value of each parser (another than the default).
SAMPLE_TEXT = {positive_int: "3", int: "3", byte_size: "2M", fraction: "0.5", str: "x",
               speculative_config_json: '{"method": "suffix"}',
               generation_config_source: "vllm", json_object: '{"temperature": 0.5}',
               kv_events_config_json: '{"topic": "x"}',
               hf_overrides_json: '{"use_pad_token": true}', cpu_turns_name: "box",
               open_fraction: "0.2"}
# Options that are only valid beside another: that one's flag and text.
COMPANIONS = {"cpu_turns_share": ("--cpu-turns", "box")}


@pytest.fixture
def parser(monkeypatch) -> argparse.ArgumentParser:
    for declared in cli_options():
        monkeypatch.delenv(env_name(declared.option.flag), raising=False)
    return make_arg_parser()


def test_names_are_unique_and_spelled_like_their_flags():
    declared = [*engine_options(), *serve_options()]
    names = [d.name for d in declared]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for d in declared:
        if d.option.flag is not None:
            assert d.name == d.option.flag.removeprefix("--").replace("-", "_"), d


def test_every_flag_is_a_declared_option_with_its_default(parser):
    actions = {a.dest: a for a in parser._actions}
    declared = {d.name: d for d in cli_options()}
    assert set(actions) - MODEL_SOURCE_DESTS == set(declared), "a flag written by hand?"
    defaults = vars(parser.parse_args([]))
    for name, d in declared.items():
        action = actions[name]
        assert d.option.flag in action.option_strings
        assert defaults[name] == d.default, name
        if not isinstance(d.default, bool):
            assert (action.type, action.choices) == (d.option.type, d.option.choices), name
        assert d.option.help in action.help and env_name(d.option.flag) in action.help


def test_groups_in_help(parser):
    titles = [g.title for g in parser._action_groups]
    assert titles[-9:] == ["model", "cache", "scheduler", "parallel", "speculative", "lora",
                           "server", "limits", "observability"]


def test_cli_defaults_are_the_dataclass_defaults(parser):
    args = parser.parse_args([])
    assert engine_config_from_args(args, "/m", "m") == EngineConfig(ModelConfig("/m", "m"))
    assert EngineConfig.from_options("/m", "m") == EngineConfig(ModelConfig("/m", "m"))
    assert ServeOptions.from_options(vars(args)) == ServeOptions()


def test_llm_signature_is_the_engine_options():
    parameters = list(inspect.signature(LLM).parameters.values())
    assert (parameters[0].name, parameters[0].default) == ("model", None)
    assert [(p.name, p.default) for p in parameters[1:]] == [
        (d.name, d.default) for d in engine_options()]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters[1:])
    # ... and LLM.__init__ itself writes none by hand: (self, model=None, **options).
    code = LLM.__init__.__code__
    assert (code.co_argcount, code.co_kwonlyargcount) == (2, 0)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)  # refused before any model is looked for


def test_a_flag_and_the_llm_keyword_set_the_same_field(parser):
    """`--flag TEXT` and `LLM(flag=TEXT)` (which EngineConfig.from_options builds) give the
    same config, and not the default one."""
    default = EngineConfig.from_options("/m", "m")
    for d in engine_options():
        if d.option.flag is None:
            continue
        if isinstance(d.default, bool):
            argv = [("--no-" + d.option.flag[2:]) if d.default else d.option.flag]
            value = not d.default
        else:
            value = d.option.choices[-1] if d.option.choices else SAMPLE_TEXT[d.option.type]
            argv = [d.option.flag, value]
        keywords = {d.name: value}
        if d.name in COMPANIONS:
            flag, text = COMPANIONS[d.name]
            argv += [flag, text]
            keywords[flag[2:].replace("-", "_")] = text
        from_cli = engine_config_from_args(parser.parse_args(argv), "/m", "m")
        from_keyword = EngineConfig.from_options("/m", "m", **keywords)
        assert from_cli == from_keyword != default, d.name
