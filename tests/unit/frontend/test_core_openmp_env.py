"""How OpenMP's threads wait (engine/openmp.py, core_client.core_openmp_env): decoders'
engine cores PASSIVE, encoders' and this process a short spin, a user's own settings kept,
the process's own default never taken for the user's, the parent's environment restored."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from engine import openmp
from engine.frontend import core_client
from engine.frontend.core_client import core_openmp_env
from engine.openmp import SHORT_SPIN_COUNT

DECODER = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
ENCODER = {"GOMP_SPINCOUNT": SHORT_SPIN_COUNT, "OMP_WAIT_POLICY": None}


def config_for(tmp_path, architectures: list[str]) -> SimpleNamespace:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
    return SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path)))


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "")  # records the value to restore, even "unset"
        monkeypatch.delenv(name)
    monkeypatch.setattr(openmp, "_ours", {})


@pytest.mark.parametrize("architectures,expected", [
    (["LlamaForCausalLM"], DECODER),
    (["Qwen3ForSequenceClassification"], DECODER),  # a decoder reranker
    (["BertModel"], ENCODER),
    (["XLMRobertaForSequenceClassification"], ENCODER),
])
def test_each_model_kind_gets_its_wait(tmp_path, clean_env, architectures, expected):
    assert core_openmp_env(config_for(tmp_path, architectures)) == expected


def test_a_bert_gguf_file_is_an_encoder(tmp_path, clean_env):
    import gguf

    path = tmp_path / "tiny-bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    config = SimpleNamespace(model_config=SimpleNamespace(model=str(path)))
    assert core_openmp_env(config) == ENCODER


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"),
                                        ("GOMP_SPINCOUNT", "5")])
def test_the_users_settings_are_kept(tmp_path, clean_env, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert core_openmp_env(config_for(tmp_path, ["BertModel"])) == {}
    assert core_openmp_env(config_for(tmp_path, ["LlamaForCausalLM"])) == {}


def test_the_process_default_is_not_the_users(tmp_path, clean_env, monkeypatch):
    """Before torch loads, importing engine sets the short spin; a decoder's core then
    still waits PASSIVE, without the inherited spin count (it would override PASSIVE)."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    openmp.set_process_default()
    assert core_client.os.environ["GOMP_SPINCOUNT"] == SHORT_SPIN_COUNT
    assert not openmp.users_choice()
    assert core_openmp_env(config_for(tmp_path, ["LlamaForCausalLM"])) == DECODER
    monkeypatch.setenv("GOMP_SPINCOUNT", "200")  # the user's own value
    assert openmp.users_choice()


def test_the_child_gets_the_settings_and_the_parent_keeps_its_own(tmp_path, clean_env,
                                                                 monkeypatch):
    seen = {}

    class RecordingProcess:
        def __init__(self, target, args, name):
            pass

        def start(self):
            seen.update(core_client.os.environ)

    monkeypatch.setattr(core_client.multiprocessing, "get_context",
                        lambda method: SimpleNamespace(Process=RecordingProcess))
    monkeypatch.setattr(openmp, "_ours", {"GOMP_SPINCOUNT": SHORT_SPIN_COUNT})
    monkeypatch.setenv("GOMP_SPINCOUNT", SHORT_SPIN_COUNT)  # this process's default
    core_client.spawn_core_process(print, (config_for(tmp_path, ["LlamaForCausalLM"]),))
    assert seen.get("OMP_WAIT_POLICY") == "PASSIVE" and "GOMP_SPINCOUNT" not in seen
    assert core_client.os.environ["GOMP_SPINCOUNT"] == SHORT_SPIN_COUNT
    assert "OMP_WAIT_POLICY" not in core_client.os.environ
