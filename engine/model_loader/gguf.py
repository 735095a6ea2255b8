"""A GGUF file as the model's source: its config and tokenizer cached once, its weights
read in place.

    $PAGEDSERVE_CACHE/gguf/<stem>-<key>/      key = hash(path, size, mtime, format version)
        config.json  generation_config.json
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        gguf_source.json   {"gguf_file": "/abs/path/model.gguf"}

With a vision projector (`--mmproj`, engine.model_loader.gguf_mmproj) the key covers both
files, config.json is the vision-language model's (the text config its `text_config`), the
processor's files join the tokenizer's, and gguf_source.json names the mmproj too
(`"mmproj_file"`).

No weights are written: `engine.model_loader.gguf_weights` memory-maps the file when the
model loads, and each tensor becomes the weight the kernels read in its own block
format. The directory is written under a temporary name and renamed into place, so it
either exists complete or not at all; a second start finds it and converts nothing.
The config comes from the GGUF metadata and the tokenizer (with its chat template)
from transformers' GGUF tokenizer support.

Architectures: llama (Llama, Mistral: a `llama.attention.sliding_window` makes it a
Mistral with that window), qwen2, qwen3, qwen3moe, gemma3 (text) and gemma2 (llama.cpp
stores their norm weights as 1 + w: `norm_offset` tells the loader to take the 1 back off),
phi3 (Phi-3,
Phi-3.5, Phi-4-mini: fused `attn_qkv` / `ffn_up` (gate and up) tensors, LongRoPE factors as
the `rope_factors_long` / `rope_factors_short` tensors); and bert, an embedding model
(all-MiniLM, bge, e5: engine.model_loader.gguf_bert writes its config, WordPiece tokenizer
and pooling).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import multiprocessing
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.model_loader import gguf_mmproj
from engine.model_loader.gguf_bert import (
    bert_config,
    bert_tensor_names,
    bert_tokenizer,
    check_bert_tensors,
    is_bert,
    save_pooling,
)
from engine.model_loader.gguf_file import GGUFFile, UnsupportedGGUFError
from engine.sampling_defaults import GGUF_SAMPLING_KEYS

# torch is never imported here: the HTTP frontend resolves models through this module.

GGUF_SOURCE_FILE = "gguf_source.json"  # {"gguf_file": path[, "mmproj_file": path]}: the
# weights live there

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 7  # bump when the output format changes: old caches are then ignored
# (6: a llama file's sliding_window, phi3)
# The dtype the cached config declares (what `--dtype auto` follows on CUDA): float32 up to
# this many parameters, bfloat16 above.
FLOAT32_MAX_PARAMS = 1_500_000_000

# GGUF architecture -> (transformers model_type, HF architecture class name)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
}
# Per-architecture names that differ from _LAYER_NAMES.
_GEMMA_NORM_NAMES = {"post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {
    "gemma3": _GEMMA_NORM_NAMES,
    "gemma2": _GEMMA_NORM_NAMES,
    # Phi-3's fused tensors keep their HF names; ffn_up holds gate rows then up rows.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# Tensors that are settings, not weights: read into the config (or ignored), never loaded.
_SETTING_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight",
                    "rope_factors_short.weight")
# llama.cpp's Gemma 3 sliding-window pattern: every 6th layer global (hard-coded there).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def default_cache_dir() -> Path:
    """$PAGEDSERVE_CACHE, or ~/.cache/pagedserve."""
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def converted_dir(gguf_path: str | Path, cache_dir: str | Path | None = None,
                  mmproj: str | Path | None = None) -> Path:
    """Where the conversion of `gguf_path` (with the vision projector `mmproj`, if given)
    lives, whether or not it exists yet."""
    gguf_path = Path(gguf_path).resolve()
    stat = gguf_path.stat()
    key = f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERTER_VERSION}"
    if mmproj is not None:
        mmproj = Path(mmproj).resolve()
        mmproj_stat = mmproj.stat()
        key += f"|mmproj {mmproj}|{mmproj_stat.st_size}|{mmproj_stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: str | Path, cache_dir: str | Path | None = None,
                     mmproj: str | Path | None = None) -> Path:
    """The HF checkpoint dir for `gguf_path` (and its vision projector `mmproj`), converting
    it first if not cached yet."""
    target = converted_dir(gguf_path, cache_dir, mmproj)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_tmp_dirs(target)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        if "torch" in sys.modules:
            convert_gguf(gguf_path, tmp, mmproj)
        else:
            # transformers' GGUF tokenizer reader imports torch: convert in a child so a
            # process without torch (the HTTP frontend, server/http/torch_free.py) stays so.
            spawn = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(1, mp_context=spawn) as pool:
                pool.submit(convert_gguf, gguf_path, tmp, mmproj).result()
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_superseded(target, Path(gguf_path).resolve(),
                       None if mmproj is None else Path(mmproj).resolve())
    return target


def _remove_superseded(target: Path, gguf_path: Path, mmproj: Path | None = None) -> None:
    """Delete the cache dirs this conversion replaces: earlier conversions of the same
    file (with the same mmproj, or none, as this one; one of them since changed), and the
    dense safetensors copies that converters before version 4 wrote for a file of this
    name (this version never reads them; they were several times the file's size)."""
    for other in target.parent.glob(f"{gguf_path.stem}-*"):
        if other == target or not other.is_dir():
            continue
        try:
            recorded = json.loads((other / GGUF_SOURCE_FILE).read_text())
        except (OSError, ValueError):
            recorded = {}
        source = recorded.get("gguf_file")
        same_pair = (source == str(gguf_path)
                     and recorded.get("mmproj_file") == (None if mmproj is None else str(mmproj)))
        dense_copy = source is None and (other / "model.safetensors").exists()
        if same_pair or dense_copy:
            logger.info("removing superseded GGUF cache %s", other)
            shutil.rmtree(other, ignore_errors=True)


def _remove_abandoned_tmp_dirs(target: Path) -> None:
    """Delete temp dirs of this conversion left by processes that no longer run."""
    for tmp in target.parent.glob(f".tmp-{target.name}-*"):
        pid = tmp.name.rsplit("-", 2)[1]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # alive, owned by someone else


# The GGML types pagedserve_kernels/cpu/gguf_blocks.h decodes (and so the types a file may use).
SUPPORTED_TYPES = tuple(GGMLQuantizationType[name] for name in (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"))


def check_tensors(gguf: GGUFFile) -> None:
    """One-line UnsupportedGGUFError for a file we cannot serve: a tensor of a type we
    lack, a tensor whose data runs past the end of the file (truncated), or a shape that
    disagrees with the metadata's model dimensions."""
    file_size = gguf.path.stat().st_size
    bert = is_bert(gguf)
    if bert:  # its shapes checked by gguf_bert against its own metadata
        check_bert_tensors(gguf)
    expected = (lambda _: None) if bert else _expected_shapes(gguf)
    for gguf_name, hf_name in hf_tensor_names(gguf):
        info = gguf.tensors[gguf_name]
        if info.ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedGGUFError(
                f"tensor {gguf_name!r} has GGML type {info.ggml_type.name}, which pagedserve "
                f"cannot serve; supported: {', '.join(t.name for t in SUPPORTED_TYPES)}")
        if info.offset + info.num_bytes > file_size:
            raise UnsupportedGGUFError(
                f"{gguf.path.name} is truncated: tensor {gguf_name!r} ends at byte "
                f"{info.offset + info.num_bytes:,}, the file at {file_size:,}")
        want = expected(hf_name)
        if want is not None and tuple(info.shape) != want:
            raise UnsupportedGGUFError(
                f"tensor {gguf_name!r} has shape {list(info.shape)}, but the file's metadata "
                f"describes a model where it is {list(want)}")


def _expected_shapes(gguf: GGUFFile):
    """HF tensor name -> the shape the metadata implies (None: not checked)."""
    arch = gguf.get("general.architecture")

    def meta(key: str, default=None):
        return gguf.get(f"{arch}.{key}", default)

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    if hidden is None or heads is None:
        raise UnsupportedGGUFError(f"{gguf.path.name}: metadata lacks {arch}.embedding_length "
                                   "or attention.head_count")
    kv_heads = meta("attention.head_count_kv", heads)
    head_dim = meta("attention.key_length", hidden // heads)
    inter = meta("feed_forward_length")
    shapes = {
        "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        # Phi-3's fused tensors: q, k, v rows stacked; gate rows, then up rows
        "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * head_dim, hidden),
        "mlp.gate_up_proj.weight": (2 * inter, hidden),
    }
    vocab = gguf.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in gguf.tensors else None
    top = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
           "model.norm.weight": (hidden,)}

    def expected(hf_name: str):
        if hf_name in top:
            return top[hf_name]
        leaf = hf_name.split(".", 3)[-1]  # model.layers.N.<leaf>
        return shapes.get(leaf)

    return expected


def convert_gguf(gguf_path: str | Path, out_dir: str | Path,
                 mmproj: str | Path | None = None) -> None:
    """Write the config, generation config and tokenizer of `gguf_path` into `out_dir`, and
    where its weights are (the file itself: nothing is dequantized here). With `mmproj`
    (a llama.cpp vision projector): the vision-language model of the two, and its processor
    (engine.model_loader.gguf_mmproj)."""
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    out_dir.mkdir(parents=True)
    gguf = GGUFFile(gguf_path)
    if gguf.get("general.architecture") == "clip":
        raise UnsupportedGGUFError(f"{gguf_path.name} is a vision projector (llama.cpp "
                                   "mmproj): pass it as --mmproj beside the text model's GGUF")
    if is_bert(gguf):
        if mmproj is not None:
            raise UnsupportedGGUFError(f"{gguf_path.name} is an embedding model (bert): "
                                       "--mmproj pairs a projector with a text model")
        _convert_bert(gguf, out_dir)
        return
    projector = None if mmproj is None else gguf_mmproj.open_mmproj(Path(mmproj).resolve())
    check_tensors(gguf)
    text_config = config_from_gguf(gguf)
    tokenizer = _save_tokenizer(gguf_path, out_dir)
    config, source = text_config, {"gguf_file": str(gguf_path)}
    if projector is not None:
        config = gguf_mmproj.vision_language_config(gguf, text_config, projector, tokenizer)
        gguf_mmproj.save_processor(projector, tokenizer, out_dir)
        source["mmproj_file"] = str(projector.path)
    config.save_pretrained(out_dir)
    _save_generation_config(text_config, out_dir, end_of_turn_ids(gguf, tokenizer),
                            gguf_sampling_defaults(gguf))
    (out_dir / GGUF_SOURCE_FILE).write_text(json.dumps(source))


def _convert_bert(gguf: GGUFFile, out_dir: Path) -> None:
    """A bert GGUF's config, tokenizer and pooling (engine.model_loader.gguf_bert); no
    generation config: an encoder generates nothing."""
    check_tensors(gguf)
    config = bert_config(gguf)
    bert_tokenizer(gguf).save_pretrained(out_dir)
    save_pooling(gguf, out_dir)
    config.save_pretrained(out_dir)
    (out_dir / GGUF_SOURCE_FILE).write_text(json.dumps({"gguf_file": str(gguf.path)}))


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file whose weights `model_dir` (a cache directory) stands for, or None."""
    path = Path(model_dir) / GGUF_SOURCE_FILE
    if not path.is_file():
        return None
    return Path(json.loads(path.read_text())["gguf_file"])


def mmproj_source(model_dir: str | Path) -> Path | None:
    """The vision projector (mmproj) GGUF `model_dir` (a cache directory) pairs with its
    text GGUF, or None (a text-only model, or no GGUF at all)."""
    path = Path(model_dir) / GGUF_SOURCE_FILE
    if not path.is_file():
        return None
    mmproj = json.loads(path.read_text()).get("mmproj_file")
    return None if mmproj is None else Path(mmproj)


def config_from_gguf(gguf: GGUFFile):
    """A transformers config for the model the GGUF metadata describes."""
    from transformers import AutoConfig

    arch = gguf.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedGGUFError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join([*_ARCHITECTURES, 'bert'])}")
    model_type, class_name = _ARCHITECTURES[arch]

    def meta(key: str, default=None):
        return gguf.get(f"{arch}.{key}", default)

    num_params = sum(math.prod(t.shape) for t in gguf.tensors.values())
    embed_shape = gguf.tensors["token_embd.weight"].shape
    kwargs = dict(
        vocab_size=embed_shape[0],
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv", meta("attention.head_count")),
        head_dim=meta("attention.key_length",
                      meta("embedding_length") // meta("attention.head_count")),
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=gguf.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=gguf.get("tokenizer.ggml.padding_token_id"),
        architectures=[class_name],
        dtype="float32" if num_params <= FLOAT32_MAX_PARAMS else "bfloat16",
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
        # A window makes it a Mistral. llama.cpp's converter writes Mistral as `llama` and
        # leaves the window out (its runtime has none for llama), so only files whose
        # writer added the key get one; the others run with full attention, as there.
        if meta("attention.sliding_window"):
            model_type, kwargs["architectures"] = "mistral", ["MistralForCausalLM"]
            kwargs["sliding_window"] = meta("attention.sliding_window")
        elif "mistral" in str(gguf.get("general.name", "")).lower():
            logger.info("%s: a Mistral GGUF without llama.attention.sliding_window: served "
                        "with full attention (as llama.cpp does; Mistral 7B v0.1's "
                        "checkpoint has a 4096-token window)", gguf.path.name)
    if arch == "gemma3":
        kwargs.update(_gemma3_config(gguf, kwargs))
    if arch == "gemma2":
        kwargs.update(_gemma2_config(gguf, kwargs))
    if arch == "phi3":
        kwargs.update(_phi3_config(gguf, kwargs))
    if arch == "qwen3moe":
        kwargs.update(
            num_experts=meta("expert_count"),
            num_experts_per_tok=meta("expert_used_count"),
            moe_intermediate_size=meta("expert_feed_forward_length"),
            norm_topk_prob=True,  # llama.cpp always renormalises the top-k weights
        )
    scaling_type = meta("rope.scaling.type")
    if scaling_type and scaling_type != "none" and arch not in ("gemma3", "gemma2", "phi3"):
        kwargs["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": meta("rope.scaling.factor"),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
        }
    if "rope_freqs.weight" in gguf.tensors:
        logger.warning("%s: per-dimension RoPE factors (rope_freqs, e.g. Llama 3.1 scaling) "
                       "are not converted; RoPE runs unscaled", gguf.path.name)
    return AutoConfig.for_model(model_type, **kwargs)


def _gemma3_config(gguf: GGUFFile, kwargs: dict) -> dict:
    """Gemma 3's settings the way llama.cpp reads its GGUF: every 6th layer global, local
    layers with a 10k RoPE base, the global base (and scaling) from the file; attention
    scale 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B (62 layers)."""
    def meta(key: str, default=None):
        return gguf.get(f"gemma3.{key}", default)

    num_layers = kwargs["num_hidden_layers"]
    window = meta("attention.sliding_window")
    layer_types = ["full_attention" if window is None or (i + 1) % GEMMA3_GLOBAL_EVERY == 0
                   else "sliding_attention" for i in range(num_layers)]
    global_rope: dict = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        global_rope.update(rope_type="linear", factor=meta("rope.scaling.factor"))
    hidden, heads = kwargs["hidden_size"], kwargs["num_attention_heads"]
    return dict(
        layer_types=layer_types, sliding_window=window or kwargs["max_position_embeddings"],
        rope_parameters={"full_attention": global_rope,
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": GEMMA3_LOCAL_ROPE_BASE}},
        query_pre_attn_scalar=hidden // heads if num_layers == 62 else kwargs["head_dim"],
        final_logit_softcapping=meta("final_logit_softcapping"),
        hidden_activation="gelu_pytorch_tanh")


def _gemma2_config(gguf: GGUFFile, kwargs: dict) -> dict:
    """Gemma 2's settings the way llama.cpp reads its GGUF: local and global layers
    alternating (even layers local; `attention.sliding_window_pattern` if the file has
    one), one RoPE base, the window (4096 when absent), both soft-caps, and the attention
    scale 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B (46 layers)."""
    def meta(key: str, default=None):
        return gguf.get(f"gemma2.{key}", default)

    num_layers = kwargs["num_hidden_layers"]
    pattern = meta("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):  # one flag per layer
        local = [bool(flag) for flag in pattern]
    else:  # every pattern-th layer global
        local = [i % pattern < pattern - 1 for i in range(num_layers)]
    hidden, heads = kwargs["hidden_size"], kwargs["num_attention_heads"]
    return dict(
        layer_types=["sliding_attention" if is_local else "full_attention" for is_local in local],
        sliding_window=meta("attention.sliding_window", 4096),
        query_pre_attn_scalar=hidden // heads if num_layers == 46 else kwargs["head_dim"],
        attn_logit_softcapping=meta("attn_logit_softcapping"),
        final_logit_softcapping=meta("final_logit_softcapping"),
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)


def _phi3_config(gguf: GGUFFile, kwargs: dict) -> dict:
    """Phi-3's settings as llama.cpp's converter writes them: the rotary dimension
    (`rope.dimension_count`: Phi-4-mini rotates 96 of 128), the sliding window (0: none),
    and LongRoPE, whose factors are the `rope_factors_long` / `rope_factors_short` tensors
    and whose cos/sin scale is `rope.scaling.attn_factor` (no `rope.scaling.type` key).

    llama.cpp itself runs every Phi-3 with full attention (its SWA is switched off for
    Phi); here the window applies, as transformers and our safetensors path apply it.
    """
    def meta(key: str, default=None):
        return gguf.get(f"phi3.{key}", default)

    head_dim = kwargs["head_dim"]
    theta = kwargs.pop("rope_theta")
    rotary_dim = meta("rope.dimension_count", head_dim)
    original = meta("rope.scaling.original_context_length", kwargs["max_position_embeddings"])
    rope: dict = {"rope_type": "default", "rope_theta": theta,
                  "partial_rotary_factor": rotary_dim / head_dim}
    if "rope_factors_long.weight" in gguf.tensors:
        rope.update(
            rope_type="longrope", original_max_position_embeddings=original,
            long_factor=[float(f) for f in gguf.load("rope_factors_long.weight")],
            short_factor=[float(f) for f in gguf.load("rope_factors_short.weight")])
        attention_factor = meta("rope.scaling.attn_factor")
        if attention_factor is not None:
            rope["attention_factor"] = float(attention_factor)
    return dict(rope_parameters=rope, partial_rotary_factor=rotary_dim / head_dim,
                original_max_position_embeddings=original,
                sliding_window=meta("attention.sliding_window") or None)


def norm_offset(gguf: GGUFFile, gguf_name: str) -> float:
    """What llama.cpp added to this tensor (Gemma's norms hold 1 + w), to take back off."""
    if gguf.get("general.architecture") in ("gemma2", "gemma3") and \
            gguf_name.endswith("norm.weight"):
        return 1.0
    return 0.0


def hf_tensor_names(gguf: GGUFFile) -> Iterator[tuple[str, str]]:
    """(GGUF tensor name, HF checkpoint name) for each tensor that holds weights.

    Stacked expert tensors [E, ...] map to the name of expert 0 with ".{e}" left as
    "{expert}" for the caller to fill: `model.layers.3.mlp.experts.{expert}.up_proj.weight`.
    Raises UnsupportedGGUFError for a tensor the architectures here have no place for.
    """
    if is_bert(gguf):
        yield from bert_tensor_names(gguf)
        return
    architecture = gguf.get("general.architecture")
    for name in gguf.tensors:
        if name not in _SETTING_TENSORS:
            yield name, hf_tensor_name(name, architecture)


def hf_tensor_name(name: str, architecture: str | None) -> str:
    """One GGUF tensor's HF checkpoint name (see hf_tensor_names). Example, llama:
    'blk.3.attn_k.weight' -> 'model.layers.3.self_attn.k_proj.weight'."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.match(name)
    if match is None:
        raise UnsupportedGGUFError(f"unsupported GGUF tensor {name!r}")
    layer, kind, leaf = match.groups()
    prefix = f"model.layers.{layer}"
    layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture, {})}
    if kind in _EXPERT_NAMES:
        return f"{prefix}.mlp.experts.{{expert}}.{_EXPERT_NAMES[kind]}.{leaf}"
    if kind in layer_names:
        return f"{prefix}.{layer_names[kind]}.{leaf}"
    raise UnsupportedGGUFError(f"unsupported GGUF tensor {name!r}")


def has_rotary_permutation(gguf: GGUFFile, gguf_name: str) -> bool:
    """Whether llama.cpp's converter permuted this tensor's rows (Llama's q/k)."""
    return gguf.get("general.architecture") == "llama" and (
        gguf_name.endswith(".attn_q.weight") or gguf_name.endswith(".attn_k.weight"))


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's halves).

    Per head of D rows, llama.cpp stores row order [0, D/2, 1, D/2+1, ...]; HF's
    is [0, 1, ..., D-1]. Example D=4: GGUF rows [a0, b0, a1, b1] -> HF [a0, a1, b0, b1].
    """
    rows = weight.shape[0]
    head_size = rows // num_heads
    grouped = weight.reshape(num_heads, head_size // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weight.shape))


def _save_tokenizer(gguf_path: Path, out_dir: Path):
    # The concrete fast class skips AutoTokenizer's config probe, which would
    # parse the whole GGUF again, seconds for a large vocabulary (docs/performance.md).
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent),
                                                        gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        logger.warning("%s carries no chat template", gguf_path.name)
    tokenizer.save_pretrained(out_dir)
    return tokenizer


# Tokens that end a chat turn in the families served (llama.cpp also stops at them by
# their text): Gemma's, Phi's, Llama 3's, ChatML's.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|end|>", "<|eot_id|>", "<|im_end|>")


def end_of_turn_ids(gguf: GGUFFile, tokenizer) -> list[int]:
    """The file's end-of-turn token ids besides its EOS: the `eot`/`eom` ids it names,
    and the end-of-turn tokens above that its vocabulary holds (a GGUF has one EOS id,
    where a checkpoint's generation_config lists Gemma's [<eos>, <end_of_turn>])."""
    ids = [gguf.get(f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")]
    vocab = tokenizer.get_vocab()
    ids += [vocab.get(token) for token in END_OF_TURN_TOKENS]
    eos = gguf.get("tokenizer.ggml.eos_token_id")
    return list(dict.fromkeys(i for i in ids if i is not None and i != eos))


def gguf_sampling_defaults(gguf: GGUFFile) -> dict[str, Any]:
    """The sampling defaults a GGUF file carries (general.sampling.temp, .top_p, .top_k,
    .min_p, .penalty_repeat), by generation_config.json's names: the server's
    --generation-config auto reads them from there (engine/sampling_defaults.py)."""
    values = {name: gguf.get(key) for key, name in GGUF_SAMPLING_KEYS.items()}
    return {name: value for name, value in values.items() if value is not None}


def _save_generation_config(config, out_dir: Path, extra_eos_ids: list[int],
                            sampling: dict[str, Any] | None = None) -> None:
    """EOS first, then the end-of-turn ids: the server stops at every one of them; and
    the file's sampling defaults."""
    from transformers import GenerationConfig

    eos_ids = [i for i in (config.eos_token_id, *extra_eos_ids) if i is not None]
    eos = eos_ids if len(eos_ids) > 1 else config.eos_token_id
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
    if sampling:  # written as given (GenerationConfig would add its own defaults)
        path = out_dir / "generation_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **sampling}, indent=2))
