"""What /api/tags, /api/ps and /api/show say of a model, checked against its own files:
the default model's GGUF metadata and tensor table, and a checkpoint's safetensors headers."""

from __future__ import annotations

import json
import math

import numpy as np
from gguf import LlamaFileType
from safetensors.numpy import save_file

from engine.model_loader.gguf_file import GGUFFile
from engine.model_loader.source import default_model_gguf, resolve_model
from server.apis.ollama.listings import model_facts, parameter_size


def test_parameter_size_is_written_as_ollama_writes_it():
    assert parameter_size(134_515_008) == "134.52M"
    assert parameter_size(1_070_000_000) == "1.1B"
    assert parameter_size(8_030_261_248) == "8.0B"
    assert parameter_size(4_096) == "4.10K"
    assert parameter_size(12) == "12"


def test_the_default_gguf_is_described_by_its_metadata():
    gguf_path = default_model_gguf()
    gguf = GGUFFile(gguf_path)
    facts = model_facts(str(resolve_model(None).path))
    details = facts.details
    assert details.format == "gguf"
    assert facts.size == gguf_path.stat().st_size  # the weights, not the cached tokenizer
    assert details.family == gguf.get("general.architecture") == "llama"
    file_type = LlamaFileType(int(gguf.get("general.file_type"))).name
    assert details.quantization_level == file_type.removeprefix("MOSTLY_") == "Q4_1"
    assert facts.num_parameters == sum(math.prod(t.shape) for t in gguf.tensors.values())
    assert details.parameter_size == "134.52M"
    assert facts.context_length == gguf.get("llama.context_length")


def test_a_checkpoint_is_described_by_its_safetensors_headers(tmp_path):
    save_file({"a": np.zeros((3, 4), np.float32), "b": np.zeros(5, np.float32)},
              str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": np.zeros((2, 2, 2), np.float32)},
              str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "torch_dtype": "bfloat16", "max_position_embeddings": 4096}))
    facts = model_facts(str(tmp_path))
    assert facts.details.format == "safetensors" and facts.details.family == "qwen3"
    assert facts.num_parameters == 12 + 5 + 8 and facts.details.quantization_level == "BF16"
    weights = sorted(tmp_path.glob("*.safetensors"))
    assert facts.size == sum(p.stat().st_size for p in weights)
    assert facts.context_length == 4096
