"""A sentence-transformers BERT checkpoint (all-MiniLM-L6-v2) as llama.cpp users get it: a
`bert` GGUF made by llama.cpp's `convert_hf_to_gguf.py` where its source tree is (see
tests/support/gguf_vision.py), else by `write_bert_gguf`, which restates what that
converter writes for a BERT (conversion/bert.py and base.py of llama.cpp 11434):

    metadata   bert.block_count, context_length, embedding_length, feed_forward_length,
               attention.head_count, attention.layer_norm_epsilon, attention.causal false,
               pooling_type (from 1_Pooling/config.json), general.file_type
    tokenizer  model "bert"; each token in phantom-space form: a word-start token gets a
               leading U+2581, a "##" continuation loses its "##", control tokens (the
               special added tokens: type 3) stay; bos/eos = [CLS]/[SEP], unk, sep, pad,
               mask ids; add_bos / add_eos true, add_sep false; normalizer.lowercase;
               token_type_count
    tensors    token_embd, token_types, position_embd, token_embd_norm,
               blk.N.attn_q/k/v, attn_output, attn_output_norm, ffn_up, ffn_down,
               layer_output_norm (weights and biases); 1-D tensors, norms, position_embd
               and token_types stay F32, the other matrices take the out type (f32, f16,
               q8_0: gguf-py's own quantizer, as the converter's)

test_gguf_bert checks the restatement against the converter's file where both can run:
the same tensors (names, types, bytes) and the same metadata but for general.* naming.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.support import gguf_vision

OUT_TYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0
POOLING_TYPES = {"pooling_mode_mean_tokens": 1, "pooling_mode_cls_token": 2,
                 "pooling_mode_lasttoken": 3}
_GLOBAL = {"embeddings.word_embeddings": "token_embd",
           "embeddings.token_type_embeddings": "token_types",
           "embeddings.position_embeddings": "position_embd",
           "embeddings.LayerNorm": "token_embd_norm"}
_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k",
          "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
          "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
          "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
_ALWAYS_F32 = ("position_embd.weight", "token_types.weight")


def convert_bert(hf_dir: Path, out: Path, outtype: str = "f16") -> Path:
    """The GGUF of `hf_dir`: llama.cpp's converter where it can run, else the restatement."""
    if gguf_vision.missing_tools() is None:
        from benchmarks.peers.llamacpp_convert import convert

        return convert(gguf_vision.LLAMA_CPP_TREE, Path(hf_dir), Path(out), outtype)
    return write_bert_gguf(hf_dir, out, outtype)


def gguf_tensor_name(hf_name: str) -> str:
    """'encoder.layer.3.attention.self.key.bias' -> 'blk.3.attn_k.bias'."""
    module, leaf = hf_name.removeprefix("bert.").rsplit(".", 1)
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{leaf}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{leaf}"


def write_bert_gguf(hf_dir: Path, out: Path, outtype: str = "f16",
                    pooling_type: int | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """`hf_dir` as llama.cpp's converter writes it (module doc). `pooling_type` overrides
    the one read from 1_Pooling; `extra_tensors` are added as they are (error tests)."""
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_name(hf_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_file_type(FILE_TYPES[outtype])
    writer.add_causal_attention(False)
    if pooling_type is None:
        pooling = json.loads((hf_dir / "1_Pooling" / "config.json").read_text())
        pooling_type = next(v for k, v in POOLING_TYPES.items() if pooling.get(k))
    writer.add_pooling_type(gguf.PoolingType(pooling_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    writer.add_token_type_count(config.get("type_vocab_size", 1))
    vocab = tokenizer["model"]["vocab"]
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    tokens = sorted(vocab, key=vocab.get)
    types = [3 if t in special else 1 for t in tokens]
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("jina-v2-en")  # what the converter's hash gives all-MiniLM
    writer.add_token_list([t if k == 3 else t[2:] if t.startswith("##") else "\u2581" + t
                           for t, k in zip(tokens, types, strict=True)])
    writer.add_token_types(types)
    template = {s["SpecialToken"]["id"] for s in tokenizer["post_processor"]["single"]
                if "SpecialToken" in s}
    cls, sep = "[CLS]", "[SEP]"
    assert template == {cls, sep}, template
    writer.add_bos_token_id(vocab[cls])
    writer.add_eos_token_id(vocab[sep])
    writer.add_unk_token_id(vocab[tokenizer["model"]["unk_token"]])
    writer.add_sep_token_id(vocab[sep])
    writer.add_pad_token_id(vocab["[PAD]"])
    writer.add_mask_token_id(vocab["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    writer.add_add_sep_token(False)
    writer.add_bool("tokenizer.ggml.normalizer.lowercase",
                    bool(tokenizer["normalizer"].get("lowercase")))

    matrix_type = gguf.GGMLQuantizationType[OUT_TYPES[outtype]]
    for hf_name, weight in load_file(str(hf_dir / "model.safetensors")).items():
        if hf_name.endswith("position_ids") or hf_name.startswith(("pooler.", "bert.pooler.")):
            continue
        name = gguf_tensor_name(hf_name)
        weight = weight.astype(np.float32)
        if weight.ndim < 2 or name.endswith("_norm.weight") or name in _ALWAYS_F32:
            writer.add_tensor(name, weight)
        elif matrix_type == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, weight.astype(np.float16))
        elif matrix_type == gguf.GGMLQuantizationType.Q8_0:
            writer.add_tensor(name, gguf.quants.quantize(weight, matrix_type),
                              raw_dtype=matrix_type)
        else:
            writer.add_tensor(name, weight)
    for name, weight in (extra_tensors or {}).items():
        writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
