"""A llama.cpp `bert` GGUF (all-MiniLM, bge, e5 as `convert_hf_to_gguf.py` writes them)
as a BERT embedding model: the config, tokenizer and pooling the conversion caches, and
the HF checkpoint name of each tensor for engine.models.bert.BertModel.

    GGUF metadata / tensors                          cached beside gguf_source.json
    bert.block_count, embedding_length, ...      ->  config.json (BertConfig, BertModel)
    tokenizer.ggml.model "bert" (WordPiece)      ->  tokenizer.json (BertNormalizer,
      tokens in llama.cpp's phantom-space form        BertPreTokenizer, WordPiece "##",
                                                      [CLS] $A [SEP])
    bert.pooling_type 1 mean / 2 cls / 3 last    ->  modules.json, 1_Pooling/config.json,
                                                      Normalize (llama-server L2-normalizes)
    token_embd, blk.N.attn_q, ...                ->  embeddings.word_embeddings,
                                                      encoder.layer.N.attention.self.query, ...

The vocabulary: llama.cpp's converter writes each WordPiece token of the original vocab
in its own spelling, a word-start token with a leading "\u2581" and a continuation with
its "##" taken off; control tokens ([CLS], [SEP], ...) as they are. Example:
"\u2581hello" -> "hello", "ing" -> "##ing", "[CLS]" -> "[CLS]". Undoing that gives back the
original vocab, id for id, so the rebuilt tokenizer gives the original's ids.

Not served (one-line errors): pooling types none (per-token vectors) and rank (a
reranker's classification head: the converter drops BERT's pooler, which the score
needs), the fused `attn_qkv` form, and `nomic-bert` (rotary).

torch is not imported here (the HTTP frontend converts models); transformers and tokenizers
are imported where a tokenizer or a config is built.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from engine.model_loader.gguf_file import GGUFFile, UnsupportedGGUFError
from engine.model_loader.pooling_config import POOLING_MODE_FLAGS

BERT_ARCHITECTURES = ("bert",)
PHANTOM_SPACE = "\u2581"
CONTINUING_PREFIX = "##"
# gguf TokenType
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's llama_pooling_type -> ours (0 none and 4 rank are refused)
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}

_GLOBAL_NAMES = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
_LAYER_NAMES = {
    "attn_q": "attention.self.query",
    "attn_k": "attention.self.key",
    "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense",
    "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense",
    "ffn_down": "output.dense",
    "layer_output_norm": "output.LayerNorm",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def is_bert(gguf: GGUFFile) -> bool:
    return gguf.get("general.architecture") in BERT_ARCHITECTURES


def _meta(gguf: GGUFFile, key: str, default=None):
    return gguf.get(f"{gguf.get('general.architecture')}.{key}", default)


def _required(gguf: GGUFFile, key: str):
    value = _meta(gguf, key)
    if value is None:
        raise UnsupportedGGUFError(f"{gguf.path.name}: metadata lacks "
                                   f"{gguf.get('general.architecture')}.{key}")
    return value


def bert_tensor_names(gguf: GGUFFile) -> Iterator[tuple[str, str]]:
    """(GGUF tensor name, HF BertModel checkpoint name) for each tensor. Example:
    'blk.2.attn_k.bias' -> 'encoder.layer.2.attention.self.key.bias'. A tensor with no
    place (a classifier head, a fused attn_qkv) is an UnsupportedGGUFError."""
    for name in gguf.tensors:
        if name in _GLOBAL_NAMES:
            yield name, _GLOBAL_NAMES[name]
            continue
        match = _LAYER_TENSOR.match(name)
        if match is None or match.group(2) not in _LAYER_NAMES:
            why = (" (a classification head: GGUF rerankers are not served)"
                   if name.startswith("cls") else
                   " (fused q/k/v: only separate attn_q / attn_k / attn_v are served)"
                   if ".attn_qkv." in name else "")
            raise UnsupportedGGUFError(f"unsupported tensor {name!r} in a bert GGUF{why}")
        layer, kind, leaf = match.groups()
        yield name, f"encoder.layer.{layer}.{_LAYER_NAMES[kind]}.{leaf}"


def check_bert_tensors(gguf: GGUFFile) -> None:
    """Every tensor BertModel needs is there, with the shape the metadata implies."""
    hidden, inter = _required(gguf, "embedding_length"), _required(gguf, "feed_forward_length")
    num_layers = _required(gguf, "block_count")
    if hidden % _required(gguf, "attention.head_count"):
        raise UnsupportedGGUFError(f"{gguf.path.name}: embedding_length {hidden} is not a "
                                   "multiple of attention.head_count")
    leaf_shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden, hidden),
                   "attn_v": (hidden, hidden), "attn_output": (hidden, hidden),
                   "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    expected: dict[str, tuple[int, ...] | None] = {
        "token_embd.weight": None, "token_types.weight": None, "position_embd.weight": None,
        "token_embd_norm.weight": (hidden,), "token_embd_norm.bias": (hidden,)}
    for i in range(num_layers):
        for kind, shape in leaf_shapes.items():
            expected[f"blk.{i}.{kind}.weight"] = shape
            expected[f"blk.{i}.{kind}.bias"] = shape[:1]
        for norm in ("attn_output_norm", "layer_output_norm"):
            expected[f"blk.{i}.{norm}.weight"] = expected[f"blk.{i}.{norm}.bias"] = (hidden,)
    for name, _ in bert_tensor_names(gguf):
        if name not in expected:
            raise UnsupportedGGUFError(f"tensor {name!r}: the metadata describes "
                                       f"{num_layers} layers")
    missing = [name for name in expected if name not in gguf.tensors]
    if missing:
        raise UnsupportedGGUFError(f"{gguf.path.name} lacks the tensors BERT needs: "
                                   f"{', '.join(missing[:4])}")
    for name, want in expected.items():
        shape = tuple(gguf.tensors[name].shape)
        if want is None:
            want = (shape[0], hidden)  # rows: vocabulary, token types, positions
        if shape != want:
            raise UnsupportedGGUFError(f"tensor {name!r} has shape {list(shape)}, but the "
                                       f"file's metadata describes a model where it is "
                                       f"{list(want)}")


def bert_config(gguf: GGUFFile):
    """The BertConfig of the model the metadata describes (BertModel: embeddings only).
    GELU is BERT's exact (erf) one, as in the checkpoints these files come from."""
    from transformers import AutoConfig

    pooling_type(gguf)  # refuse what we cannot pool before anything is written
    return AutoConfig.for_model(
        "bert",
        vocab_size=gguf.tensors["token_embd.weight"].shape[0],
        hidden_size=_required(gguf, "embedding_length"),
        num_hidden_layers=_required(gguf, "block_count"),
        num_attention_heads=_required(gguf, "attention.head_count"),
        intermediate_size=_required(gguf, "feed_forward_length"),
        max_position_embeddings=gguf.tensors["position_embd.weight"].shape[0],
        type_vocab_size=gguf.tensors["token_types.weight"].shape[0],
        layer_norm_eps=_meta(gguf, "attention.layer_norm_epsilon", 1e-12),
        hidden_act="gelu",
        pad_token_id=gguf.get("tokenizer.ggml.padding_token_id", 0),
        architectures=["BertModel"],
        dtype="float32",
    )


def pooling_type(gguf: GGUFFile) -> str | None:
    """Our pooling type for the file's bert.pooling_type (None: the key is absent, and the
    model pools as a checkpoint without modules.json does: its [CLS] token)."""
    value = _meta(gguf, "pooling_type")
    if value is None:
        return None
    if value not in POOLING_TYPES:
        what = {0: "none (per-token vectors)", 4: "rank (a reranker)"}.get(value, str(value))
        raise UnsupportedGGUFError(f"{gguf.path.name}: pooling type {what} is not served; "
                                   "mean (1), cls (2) and last (3) are")
    return POOLING_TYPES[value]


def save_pooling(gguf: GGUFFile, out_dir: Path) -> None:
    """The file's pooling as sentence-transformers' modules (read back by
    engine.model_loader.pooling_config), always with Normalize: llama-server's
    /v1/embeddings L2-normalizes by default."""
    pooling = pooling_type(gguf)
    if pooling is None:
        return
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir()
    flags = {flag: mode == pooling for flag, mode in POOLING_MODE_FLAGS}
    config = {"word_embedding_dimension": _required(gguf, "embedding_length"), **flags}
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))


def original_vocab(gguf: GGUFFile) -> dict[str, int]:
    """The WordPiece vocabulary the converter started from (see the module doc)."""
    tokens = gguf.get("tokenizer.ggml.tokens")
    types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens or [])
    if not tokens or len(types) != len(tokens):
        raise UnsupportedGGUFError(f"{gguf.path.name}: no tokenizer.ggml.tokens / token_type")
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != _CONTROL:
            token = (token[1:] if token.startswith(PHANTOM_SPACE)
                     else CONTINUING_PREFIX + token)
        vocab.setdefault(token, index)
    return vocab


def bert_tokenizer(gguf: GGUFFile):
    """The WordPiece tokenizer of a `tokenizer.ggml.model` "bert" file, as transformers'
    BERT tokenizer builds it: BertNormalizer (lowercase and accent stripping as the file
    says: tokenizer.ggml.normalizer.lowercase / .strip_accents, both true by default as in
    llama.cpp), BertPreTokenizer, WordPiece with "##", and [CLS] $A [SEP]."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece
    from transformers import PreTrainedTokenizerFast

    model = gguf.get("tokenizer.ggml.model")
    if model != "bert":
        raise UnsupportedGGUFError(f"{gguf.path.name}: tokenizer.ggml.model {model!r}; a bert "
                                   "GGUF's tokenizer is served when it is \"bert\" (WordPiece)")
    tokens = gguf.get("tokenizer.ggml.tokens")
    vocab = original_vocab(gguf)

    def token_at(key: str, default: int | None = None) -> str | None:
        index = gguf.get(f"tokenizer.ggml.{key}", default)
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    unk = token_at("unknown_token_id")
    cls = token_at("cls_token_id", gguf.get("tokenizer.ggml.bos_token_id"))
    sep = token_at("seperator_token_id", gguf.get("tokenizer.ggml.eos_token_id"))
    if unk is None or cls is None or sep is None:
        raise UnsupportedGGUFError(f"{gguf.path.name}: the tokenizer lacks an unknown, BOS "
                                   "([CLS]) or separator token id")
    lowercase = bool(gguf.get("tokenizer.ggml.normalizer.lowercase", True))
    backend = Tokenizer(WordPiece(vocab, unk_token=unk, continuing_subword_prefix="##",
                                  max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, lowercase=lowercase,
        strip_accents=bool(gguf.get("tokenizer.ggml.normalizer.strip_accents", lowercase)))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    first = f"{cls}:0 " if gguf.get("tokenizer.ggml.add_bos_token", True) else ""
    last = f" {sep}:0" if gguf.get("tokenizer.ggml.add_eos_token", True) else ""
    backend.post_processor = processors.TemplateProcessing(
        single=f"{first}$A:0{last}", pair=f"{first}$A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    types = gguf.get("tokenizer.ggml.token_type")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types, strict=True)
                                if kind == _CONTROL])
    user = [t for t, i in vocab.items() if types[i] == _USER_DEFINED]
    if user:
        backend.add_tokens(user)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token=unk, cls_token=cls, sep_token=sep,
        pad_token=token_at("padding_token_id"), mask_token=token_at("mask_token_id"),
        model_max_length=gguf.tensors["position_embd.weight"].shape[0])
