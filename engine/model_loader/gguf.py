"""GGUF -> a normal HF checkpoint directory, converted once and cached.

    $PAGEDSERVE_CACHE/gguf/<stem>-<key>/      key = hash(file name, size, mtime, converter version)
        config.json  generation_config.json
        gguf_tensor_types.json  (HF tensor name -> GGML type, e.g. "Q4_1": what
                                 --quantization auto serves it as)
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        model.safetensors  (or model-0000i-of-0000n.safetensors + index)

The directory is written under a temporary name and renamed into place, so
it either exists complete or not at all; a second start finds it and
converts nothing. Weights are dequantized to float32 (bfloat16 for models
over `FLOAT32_MAX_PARAMS`), the config comes from the GGUF metadata and the
tokenizer (with its chat template) from transformers' GGUF tokenizer support.

Architectures: llama, qwen2, qwen3, qwen3moe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from engine.model_loader.gguf_file import GGUFFile, UnsupportedGGUFError

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that convert (lazily): the HTTP frontend resolves
# models through this module and never needs torch itself.

GGUF_TYPES_FILE = "gguf_tensor_types.json"  # read by engine.model_loader.quantize

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 2  # bump when the output format changes: old caches are then ignored
FLOAT32_MAX_PARAMS = 1_500_000_000
SHARD_BYTES = 2 << 30

# GGUF architecture -> (transformers model_type, HF architecture class name)
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
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


def converted_dir(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the conversion of `gguf_path` lives (whether or not it exists yet)."""
    gguf_path = Path(gguf_path)
    stat = gguf_path.stat()
    key = f"{gguf_path.name}|{stat.st_size}|{stat.st_mtime_ns}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The HF checkpoint dir for `gguf_path`, converting it first if not cached yet."""
    target = converted_dir(gguf_path, cache_dir)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_tmp_dirs(target)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write config, tokenizer and dequantized safetensors weights of `gguf_path` into `out_dir`."""
    import torch

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    out_dir.mkdir(parents=True)
    gguf = GGUFFile(gguf_path)
    num_params = sum(int(np.prod(t.shape)) for t in gguf.tensors.values())
    dtype = torch.float32 if num_params <= FLOAT32_MAX_PARAMS else torch.bfloat16
    config = config_from_gguf(gguf, dtype)
    with tqdm(total=len(gguf.tensors) + 1, unit="tensor",
              desc=f"converting {gguf_path.name} (once)") as progress:
        progress.set_postfix_str("tokenizer", refresh=False)
        _save_tokenizer(gguf_path, out_dir)
        progress.update()
        config.save_pretrained(out_dir)
        _save_generation_config(config, out_dir)
        types: dict[str, str] = {}
        _save_weights(gguf_tensors(gguf, config, progress, types), out_dir, dtype)
        (out_dir / GGUF_TYPES_FILE).write_text(json.dumps(types, indent=1, sort_keys=True))


def config_from_gguf(gguf: GGUFFile, dtype: torch.dtype):
    """A transformers config for the model the GGUF metadata describes."""
    from transformers import AutoConfig

    arch = gguf.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedGGUFError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(_ARCHITECTURES)}")
    model_type, class_name = _ARCHITECTURES[arch]

    def meta(key: str, default=None):
        return gguf.get(f"{arch}.{key}", default)

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
        dtype=str(dtype).removeprefix("torch."),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if arch == "qwen3moe":
        kwargs.update(
            num_experts=meta("expert_count"),
            num_experts_per_tok=meta("expert_used_count"),
            moe_intermediate_size=meta("expert_feed_forward_length"),
            norm_topk_prob=True,  # llama.cpp always renormalises the top-k weights
        )
    scaling_type = meta("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        kwargs["rope_scaling"] = {
            "rope_type": scaling_type,
            "factor": meta("rope.scaling.factor"),
            "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
        }
    if "rope_freqs.weight" in gguf.tensors:
        logger.warning("%s: per-dimension RoPE factors (rope_freqs, e.g. Llama 3.1 scaling) "
                       "are not converted; RoPE runs unscaled", gguf.path.name)
    return AutoConfig.for_model(model_type, **kwargs)


def gguf_tensors(gguf: GGUFFile, config, progress=None, types: dict[str, str] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for each GGUF tensor, dequantized one at a time.

    `types`, if given, receives HF name -> the GGUF tensor's GGML type name.

    llama.cpp's converter permutes Llama's q/k rows for its rotary layout; they
    are permuted back here. Stacked expert tensors [E, ...] are split per expert.
    """
    import torch

    arch = gguf.get("general.architecture")
    for name in gguf.tensors:
        if progress is not None:
            progress.set_postfix_str(name, refresh=False)
        if name == "rope_freqs.weight":
            pass
        elif name in _GLOBAL_NAMES:
            if types is not None:
                types[_GLOBAL_NAMES[name]] = gguf.tensors[name].ggml_type.name
            yield _GLOBAL_NAMES[name], torch.from_numpy(gguf.load(name))
        else:
            match = _LAYER_TENSOR.match(name)
            if match is None:
                raise UnsupportedGGUFError(f"unsupported GGUF tensor {name!r}")
            layer, kind, leaf = match.groups()
            prefix = f"model.layers.{layer}"
            array = gguf.load(name)
            if kind in _EXPERT_NAMES:
                for expert, weights in enumerate(array):
                    # (expert tensors are fused in the model and stay dense: no type recorded)
                    yield (f"{prefix}.mlp.experts.{expert}.{_EXPERT_NAMES[kind]}.{leaf}",
                           torch.from_numpy(np.ascontiguousarray(weights)))
                continue
            if kind not in _LAYER_NAMES:
                raise UnsupportedGGUFError(f"unsupported GGUF tensor {name!r}")
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
                array = unpermute_rotary_rows(array, heads)
            hf_name = f"{prefix}.{_LAYER_NAMES[kind]}.{leaf}"
            if types is not None:
                types[hf_name] = gguf.tensors[name].ggml_type.name
            yield hf_name, torch.from_numpy(array)
        if progress is not None:
            progress.update()


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's halves).

    Per head of D rows, llama.cpp stores row order [0, D/2, 1, D/2+1, ...]; HF's
    is [0, 1, ..., D-1]. Example D=4: GGUF rows [a0, b0, a1, b1] -> HF [a0, a1, b0, b1].
    """
    rows = weight.shape[0]
    head_size = rows // num_heads
    grouped = weight.reshape(num_heads, head_size // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2).reshape(weight.shape))


def _save_weights(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path,
                  dtype: torch.dtype) -> None:
    """Stream tensors into shards of about SHARD_BYTES; one file if they all fit."""
    from safetensors.torch import save_file

    parts: list[list[str]] = []  # tensor names of each written part
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        save_file(shard, str(out_dir / f"part-{len(parts):05d}.safetensors"),
                  metadata={"format": "pt"})
        parts.append(list(shard))
        shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        tensor = tensor.to(dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > SHARD_BYTES:
            flush()
        shard[name] = tensor
        shard_bytes += size
    flush()
    if len(parts) == 1:
        os.rename(out_dir / "part-00000.safetensors", out_dir / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        os.rename(out_dir / f"part-{i:05d}.safetensors", out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    # The concrete fast class skips AutoTokenizer's config probe, which would
    # parse the whole GGUF again (~8 s for a 49k vocabulary).
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent),
                                                        gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        logger.warning("%s carries no chat template", gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def _save_generation_config(config, out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)
