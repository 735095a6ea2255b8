"""GPU offline throughput: pagedserve with decode CUDA graphs, pagedserve with
--enforce-eager, and `transformers` `generate`, on one random-weight model of
SmolLM2-135M's shape (built where it runs: no checkpoint travels), same workload.

    python -m benchmarks.gpu_bench --out results/gpu_bench.json     # on a CUDA machine
    python -m benchmarks.gpu_bench --dry-run --out /tmp/bench.json  # CPU, a toy model, seconds

The workload is benchmarks.throughput's (seeded random prompts, ignore_eos, so every
request makes exactly its output length). Random weights cost what trained ones do.
--dry-run runs every part on the CPU at a toy size: it checks the wiring, not speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.throughput import ThroughputResult, Workload, make_workload

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json): Llama, tied embeddings.
SMOLLM2_135M_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
)
TOY_SHAPE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
)


@dataclass(frozen=True)
class BenchConfig:
    device: str
    dtype: str
    shape: dict
    num_prompts: int
    input_min: int
    input_max: int
    output_min: int
    output_max: int
    max_num_seqs: int
    hf_batch_size: int
    gpu_memory_utilization: float
    seed: int = 0


GPU_CONFIG = BenchConfig(device="cuda", dtype="bfloat16", shape=SMOLLM2_135M_SHAPE,
                         num_prompts=256, input_min=128, input_max=512, output_min=128,
                         output_max=256, max_num_seqs=256, hf_batch_size=64,
                         gpu_memory_utilization=0.4)
DRY_RUN_CONFIG = BenchConfig(device="cpu", dtype="float32", shape=TOY_SHAPE, num_prompts=4,
                             input_min=8, input_max=16, output_min=4, output_max=8,
                             max_num_seqs=4, hf_batch_size=2, gpu_memory_utilization=0.4)


def build_random_checkpoint(out_dir: Path, shape: dict, seed: int = 0) -> Path:
    """A Llama checkpoint of `shape` with random weights and a word-level tokenizer
    naming every id ("t0", "t1", ...), so any sampled id detokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab_size = shape["vocab_size"]
    torch.manual_seed(seed)
    config = LlamaConfig(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out_dir)
    word_level = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)},
                                            unk_token="t3"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="t0", eos_token="t1",
                            pad_token="t2", unk_token="t3").save_pretrained(out_dir)
    return out_dir


def run_pagedserve(name: str, model_dir: Path, bench: BenchConfig, workload: Workload,
                   enforce_eager: bool) -> dict:
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(str(model_dir), dtype=bench.dtype, device=bench.device,
              max_num_seqs=bench.max_num_seqs, max_num_batched_tokens=8192,
              max_model_len=bench.shape["max_position_embeddings"],
              gpu_memory_utilization=bench.gpu_memory_utilization,
              kv_cache_memory="256M" if bench.device == "cpu" else None,
              enforce_eager=enforce_eager)
    startup_s = time.perf_counter() - start
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    llm.generate(workload.prompts[:8], params[:8], use_tqdm=False)  # warm-up: Triton compiles
    _synchronize(bench.device)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    _synchronize(bench.device)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    runner = llm.engine_core.executor.runner
    graphs = runner.decode_graphs
    extra = dict(startup_s=startup_s, backend=runner.backend.name,
                 num_graphs=len(graphs.graphs) if graphs is not None else 0,
                 graph_steps=graphs.num_replays if graphs is not None else 0)
    llm.shutdown()
    return _row(ThroughputResult(name, elapsed, len(outputs), workload.num_prompt_tokens,
                                 produced), extra)


def run_transformers(model_dir: Path, bench: BenchConfig, workload: Workload) -> dict:
    """Static batches of `hf_batch_size`, left-padded; a batch runs to its longest output."""
    from transformers import AutoModelForCausalLM

    device = torch.device(bench.device)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, bench.dtype)).to(device).eval()
    pad_id = 2

    def generate(prompts: list[list[int]], max_new: int) -> None:
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            model.generate(input_ids=input_ids.to(device),
                           attention_mask=attention_mask.to(device), do_sample=False,
                           max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad_id)

    generate(workload.prompts[:2], 4)  # warm-up
    _synchronize(bench.device)
    start = time.perf_counter()
    size = bench.hf_batch_size
    for first in range(0, len(workload.prompts), size):
        generate(workload.prompts[first:first + size],
                 max(workload.output_lens[first:first + size]))
    _synchronize(bench.device)
    elapsed = time.perf_counter() - start
    return _row(ThroughputResult("transformers", elapsed, len(workload.prompts),
                                 workload.num_prompt_tokens, workload.num_output_tokens),
                dict(batch_size=size))


def _row(result: ThroughputResult, extra: dict) -> dict:
    return asdict(result) | {"output_tokens_per_s": result.output_tokens_per_s,
                             "total_tokens_per_s": (result.prompt_tokens
                                                    + result.output_tokens) / result.elapsed_s
                             } | extra


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def environment(bench: BenchConfig) -> dict:
    import transformers

    env = dict(python=platform.python_version(), torch=torch.__version__,
               transformers=transformers.__version__, device=bench.device)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if bench.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the results (JSON)")
    parser.add_argument("--dry-run", action="store_true",
                        help="a toy model on the CPU: checks that every part runs")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)
    bench = DRY_RUN_CONFIG if args.dry_run else GPU_CONFIG
    if bench.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run on a CPU machine")

    workload = make_workload(argparse.Namespace(**asdict(bench)), bench.shape["vocab_size"],
                             {0, 1, 2, 3})
    print(f"workload: {bench.num_prompts} prompts, {workload.num_prompt_tokens} prompt "
          f"tokens, {workload.num_output_tokens} output tokens, {bench.dtype} on {bench.device}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        model_dir = build_random_checkpoint(Path(tmp), bench.shape, bench.seed)
        rows = [run_pagedserve("pagedserve (CUDA graphs)", model_dir, bench, workload, False),
                run_pagedserve("pagedserve (--enforce-eager)", model_dir, bench, workload,
                               True)]
        if not args.skip_transformers:
            rows.append(run_transformers(model_dir, bench, workload))
    for row in rows:
        print(f"{row['name']:<30}{row['elapsed_s']:>8.2f} s{row['output_tokens_per_s']:>12.1f} "
              "output tok/s", flush=True)
    result = dict(bench=asdict(bench), environment=environment(bench), dry_run=args.dry_run,
                  results=rows)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
