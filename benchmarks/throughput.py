"""Offline throughput: pagedserve's `LLM` vs `transformers` `generate`, same workload.

    python -m benchmarks.throughput --dtype bfloat16            # default model
    python -m benchmarks.throughput --model DIR --num-prompts 64 --dtype float32
    python -m benchmarks.throughput --model MOE_DIR --skip-transformers \
        --tensor-parallel-size 2 [--enable-expert-parallel]     # MoE: TP vs EP experts

The workload is seeded: `--num-prompts` prompts of random token ids with lengths
drawn from [--input-min, --input-max] and output lengths from [--output-min,
--output-max], generated with ignore_eos so every request makes exactly its output
length. `transformers` runs static batches of `--hf-batch-size` (left-padded; a
batch runs until its longest request is done; only the requested tokens count).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult:
    name: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.elapsed_s


def make_workload(args: argparse.Namespace, vocab_size: int, special_ids: set[int]) -> Workload:
    rng = np.random.default_rng(args.seed)
    allowed = np.array([i for i in range(vocab_size) if i not in special_ids])
    prompts, output_lens = [], []
    for _ in range(args.num_prompts):
        length = int(rng.integers(args.input_min, args.input_max + 1))
        prompts.append(rng.choice(allowed, size=length).tolist())
        output_lens.append(int(rng.integers(args.output_min, args.output_max + 1)))
    return Workload(prompts, output_lens)


def run_pagedserve(args: argparse.Namespace, workload: Workload) -> ThroughputResult:
    from engine import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
    )
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    return ThroughputResult(
        "pagedserve", elapsed, len(outputs), workload.num_prompt_tokens, produced
    )


def run_transformers(
    args: argparse.Namespace, workload: Workload, model_dir: str, dtype: torch.dtype, pad_id: int
) -> ThroughputResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    batch_size = args.hf_batch_size
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        max_new = max(workload.output_lens[first : first + batch_size])
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):  # left padding
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=pad_id,
            )
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        "transformers",
        elapsed,
        len(workload.prompts),
        workload.num_prompt_tokens,
        workload.num_output_tokens,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-min", type=int, default=100)
    parser.add_argument("--input-max", type=int, default=500)
    parser.add_argument("--output-min", type=int, default=100)
    parser.add_argument("--output-max", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory", default="2G")
    parser.add_argument("--quantization", default="auto",
                        help="pagedserve's --quantization (auto: its default)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE with --tensor-parallel-size > 1: split whole experts")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--result-file", default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    model_dir = resolve_model(args.model).path
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = make_workload(args, len(tokenizer), set(tokenizer.all_special_ids))
    print(
        f"workload: {args.num_prompts} prompts, {workload.num_prompt_tokens} prompt tokens, "
        f"{workload.num_output_tokens} output tokens, dtype {args.dtype}, "
        f"torch threads {torch.get_num_threads()}"
    )
    results = [run_pagedserve(args, workload)]
    if not args.skip_transformers:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        results.append(
            run_transformers(args, workload, model_dir, getattr(torch, args.dtype), pad_id)
        )
    print(f"{'engine':<14}{'time s':>10}{'prompt tok/s':>15}{'output tok/s':>15}")
    for r in results:
        print(
            f"{r.name:<14}{r.elapsed_s:>10.1f}{r.prompt_tokens_per_s:>15.1f}"
            f"{r.output_tokens_per_s:>15.1f}"
        )
    if len(results) == 2:
        print(
            f"output tok/s ratio pagedserve / transformers: "
            f"{results[0].output_tokens_per_s / results[1].output_tokens_per_s:.2f}x"
        )
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(
                [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results],
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
