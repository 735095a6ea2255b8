"""The engine core's OpenMP settings (engine/frontend/core_client.py, core_openmp_env):
decoders wait PASSIVE, encoders spin briefly, a user's own settings are kept, and the
parent's environment is left as it was."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from engine.frontend import core_client
from engine.frontend.core_client import ENCODER_SPIN_COUNT, core_openmp_env


def config_for(tmp_path, architectures: list[str]) -> SimpleNamespace:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": architectures}))
    return SimpleNamespace(model_config=SimpleNamespace(model=str(tmp_path)))


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)


@pytest.mark.parametrize("architectures,expected", [
    (["LlamaForCausalLM"], {"OMP_WAIT_POLICY": "PASSIVE"}),
    (["Qwen3ForSequenceClassification"], {"OMP_WAIT_POLICY": "PASSIVE"}),  # a decoder
    (["BertModel"], {"GOMP_SPINCOUNT": ENCODER_SPIN_COUNT}),
    (["XLMRobertaForSequenceClassification"], {"GOMP_SPINCOUNT": ENCODER_SPIN_COUNT}),
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
    assert core_openmp_env(config) == {"GOMP_SPINCOUNT": ENCODER_SPIN_COUNT}


@pytest.mark.parametrize("name,value", [("OMP_WAIT_POLICY", "ACTIVE"),
                                        ("GOMP_SPINCOUNT", "5")])
def test_the_users_settings_are_kept(tmp_path, clean_env, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert core_openmp_env(config_for(tmp_path, ["BertModel"])) == {}


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
    core_client.spawn_core_process(print, (config_for(tmp_path, ["BertModel"]),))
    assert seen.get("GOMP_SPINCOUNT") == ENCODER_SPIN_COUNT
    assert "OMP_WAIT_POLICY" not in seen
    assert "GOMP_SPINCOUNT" not in core_client.os.environ
