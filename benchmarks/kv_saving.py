"""KV blocks held by a burst of long contexts: sliding-window KV groups against full attention.

A tiny random Gemma-3-shaped model (5 local : 1 global layers, `--window` tokens) and the
same model with every layer global both serve `--num-clients` requests of `--context-len`
prompt tokens (+ `--output-len` generated), all submitted at once, on the real engine
(CPU, chunked prefill; the default 160 output tokens outlast the burst's prefill, so all
32 contexts are resident at once while they decode). After every step the KV manager's blocks held by live requests are
counted; the table reports the peak. Counts only, no timing: the model is tiny so the run
is fast, and the counts depend only on the lengths, the window and the block size.

    python -m benchmarks.kv_saving                        # 32 clients x 8k tokens
    python -m benchmarks.kv_saving --num-clients 4 --context-len 512   # a quick look

A block id of the windowed model holds `group_size` layers (engine.kv_cache.groups), one of
the full model all of them, so the comparison is in layer-blocks (block ids x layers per
id) and in the bytes a real model would need (`--bytes-per-layer-block`, default Gemma 3
1B's: 1 KV head x 256 dims x K and V x bf16 x 16 tokens = 16 KiB).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

GEMMA3_1B_LAYER_BLOCK_BYTES = 1 * 256 * 2 * 2 * 16


@dataclass
class Result:
    model: str  # "sliding window (5 local : 1 global)" | "full attention"
    kv_cache_groups: list[str]
    layers_per_block_id: int
    peak_block_ids: int  # over the whole burst (prefill chunks included)
    peak_layer_blocks: int
    peak_bytes_real_model: int
    decode_block_ids: int  # the most held in a decode-only step (every prompt done)
    decode_layer_blocks: int
    num_preemptions: int


def tiny_gemma3(out_dir: Path, num_layers: int, window: int | None, max_len: int) -> Path:
    """Save a random Gemma-3-shaped checkpoint: every 6th layer global; with window None
    every layer global (full attention)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    layer_types = ["full_attention" if window is None or (i + 1) % 6 == 0
                   else "sliding_attention" for i in range(num_layers)]
    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=window or max_len, layer_types=layer_types,
        max_position_embeddings=max_len, architectures=["Gemma3ForCausalLM"],
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(out_dir)
    vocab = {f"t{i}": i for i in range(512)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(out_dir)
    return out_dir


def measure(model_dir: Path, name: str, num_groups: int, args) -> Result:
    from engine import LLM, SamplingParams

    max_len = args.context_len + args.output_len + 1
    per_request = -(-max_len // args.block_size)
    # Room for every request whole in every group at once: nothing is ever preempted.
    num_blocks = args.num_clients * per_request * num_groups + 64
    llm = LLM(str(model_dir), dtype="float32", max_model_len=max_len,
              block_size=args.block_size, max_num_seqs=args.num_clients,
              max_num_batched_tokens=args.max_num_batched_tokens,
              num_gpu_blocks_override=num_blocks, enable_prefix_caching=False)
    core = llm.engine_core
    manager = core.scheduler.kv_cache_manager
    peak, decode_peak = [0], [0]
    scheduler = core.scheduler
    original_schedule = scheduler.schedule

    def schedule():
        # Counted right after scheduling: the step's blocks are allocated, none of its
        # finished requests freed yet.
        output = original_schedule()
        held = num_blocks - manager.block_pool.get_num_free_blocks()
        peak[0] = max(peak[0], held)
        if scheduler.running and all(r.num_computed_tokens > r.num_prompt_tokens
                                     for r in scheduler.running):
            decode_peak[0] = max(decode_peak[0], held)  # every request past its prompt
        return output

    scheduler.schedule = schedule
    preemptions = [0]
    original_step = core.step

    def step():
        outputs = original_step()
        preemptions[0] += outputs.scheduler_stats.num_preemptions
        return outputs

    core.step = step
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=args.context_len).tolist()
               for _ in range(args.num_clients)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert manager.usage == 0, "blocks left held after the burst"
    layers_per_id = max(len(g.layer_indices) for g in manager.group_specs)
    llm.shutdown()
    return Result(name, [f"{g.kind}: {len(g.layer_indices)} layers" for g in manager.group_specs],
                  layers_per_id, peak[0], peak[0] * layers_per_id,
                  peak[0] * layers_per_id * args.bytes_per_layer_block,
                  decode_peak[0], decode_peak[0] * layers_per_id, preemptions[0])


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-clients", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=8192)
    parser.add_argument("--output-len", type=int, default=160)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--bytes-per-layer-block", type=int, default=GEMMA3_1B_LAYER_BLOCK_BYTES)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    max_len = args.context_len + args.output_len + 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("sliding window (5 local : 1 global)", args.window),
                             ("full attention", None)):
            model_dir = tiny_gemma3(Path(tmp) / name.split()[0], args.num_layers, window,
                                    max_len)
            num_global = sum(1 for i in range(args.num_layers) if (i + 1) % 6 == 0)
            num_groups = 1 if window is None else 1 + -(-(args.num_layers - num_global)
                                                        // num_global)
            results.append(measure(model_dir, name, num_groups, args))
    if args.json:
        print(json.dumps([asdict(r) for r in results], indent=2))
    else:
        print(f"{args.num_clients} clients x {args.context_len} prompt + {args.output_len} "
              f"output tokens, {args.num_layers} layers, window {args.window}, "
              f"block size {args.block_size}")
        print("| model | layers / block id | peak block ids | peak layer-blocks | "
              "peak at 16 KiB / layer-block | decoding: block ids | decoding: layer-blocks |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in results:
            print(f"| {r.model} | {r.layers_per_block_id} | {r.peak_block_ids:,} | "
                  f"{r.peak_layer_blocks:,} | {r.peak_bytes_real_model / 2**20:,.0f} MiB | "
                  f"{r.decode_block_ids:,} | {r.decode_layer_blocks:,} |")
        sliding, full = results
        print(f"full attention holds {full.peak_layer_blocks / max(sliding.peak_layer_blocks, 1):.2f}x"
              f" the KV at the peak, {full.decode_layer_blocks / max(sliding.decode_layer_blocks, 1):.2f}x"
              " while decoding; preemptions: "
              f"{sliding.num_preemptions} / {full.num_preemptions}")
    return results


if __name__ == "__main__":
    main()
