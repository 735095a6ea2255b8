"""Tensor parallelism on the CPU (gloo): the same greedy tokens as one rank and as
transformers, logprobs within 1e-3 of one rank, and the index arithmetic behind it.

Each engine case runs prompts that share a prefix (twice: the second pass hits the
prefix cache) with chunked prefill (32-token steps) and a KV pool small enough to
preempt, once with TP=1 and once with TP=2 worker processes. The cases cover the four
architectures, replicated KV heads (1 KV head over 2 ranks), a padded vocabulary with
a tied lm_head (511 rows over 2 ranks), and int4 linears quantized per shard.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.sharding import (
    RowRange,
    check_tensor_parallel,
    padded_range,
    shard_heads,
)
from engine.executor.messages import Step, StepDone, core_side_codec, worker_side_codec
from engine.executor.multiproc_executor import plan_rank_cpus
from engine.outputs import Logprobs, ModelRunnerOutput
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tests.support.correctness import count_preemptions
from tests.support.hf_reference import assert_greedy_matches, hf_greedy_reference
from tests.support.model_fixtures import build_tiny_checkpoint, tiny_config

NUM_NEW_TOKENS = 12
PROMPT_LENS = [5, 60, 17, 100, 40, 9]
SHARED_PREFIX = 32


@pytest.fixture(autouse=True)
def no_leftover_workers():
    yield
    leftover = multiprocessing.active_children()
    for process in leftover:
        process.kill()
    assert not leftover, f"worker processes left behind: {leftover}"


# ------------------------------------------------------------------- index arithmetic
def test_heads_split_or_replicated():
    # 8 query heads, 2 KV heads, head_size 16.
    two = [shard_heads(8, 2, 16, rank, 2) for rank in range(2)]
    assert [(s.num_heads, s.num_kv_heads) for s in two] == [(4, 1), (4, 1)]
    assert two[1].q_rows == RowRange(64, 64) and two[1].kv_rows == RowRange(16, 16)
    four = [shard_heads(8, 2, 16, rank, 4) for rank in range(4)]
    # ranks 0, 1 replicate KV head 0; ranks 2, 3 KV head 1
    assert [s.kv_rows.start // 16 for s in four] == [0, 0, 1, 1]
    assert [s.q_rows.start // 16 for s in four] == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="attention heads"):
        shard_heads(9, 3, 64, 0, 2)


def test_padded_vocab():
    assert [padded_range(10, r, 3) for r in range(3)] == [
        (RowRange(0, 4), 4), (RowRange(4, 4), 4), (RowRange(8, 2), 4)]


def test_smollm2_shape_check_names_the_heads():
    # SmolLM2-135M: 9 attention heads, 3 KV heads, intermediate 1536.
    from transformers import LlamaConfig

    config = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                         head_dim=64, intermediate_size=1536)
    check_tensor_parallel(config, 3)
    with pytest.raises(ValueError) as info:
        check_tensor_parallel(config, 2)
    message = str(info.value)
    assert "\n" not in message
    assert "--tensor-parallel-size 2" in message and "9 attention heads" in message
    assert "fit: 1, 3" in message


def test_rank_cpu_plan():
    assert plan_rank_cpus((0, 1, 2, 3), 4, 2) == [((0, 1), 2), ((2, 3), 2)]
    assert plan_rank_cpus((0, 1), 2, 3) == [((0,), 1), ((1,), 1), ((0,), 1)]


def test_step_messages_round_trip_typed():
    from engine.sampling_params import SamplingParams as Params

    output = SchedulerOutput(
        [NewRequestData("a", [1, 2, 3], Params(temperature=0.0), [0, 1], 0, 5)],
        CachedRequestData(["b"], [False], [[3]], [7]), {"b": 1, "a": 3}, 4, {"x"}, {"y"})
    decoded = worker_side_codec().decode(core_side_codec().encode(Step(output)))
    assert decoded.scheduler_output == output
    assert list(decoded.scheduler_output.num_scheduled_tokens) == ["b", "a"]  # batch order
    done = StepDone(ModelRunnerOutput(["a"], {"a": 0}, [[9]], {"a": Logprobs([[9]], [[-0.5]], [1])}))
    assert core_side_codec().decode(worker_side_codec().encode(done)) == done


# ------------------------------------------------------------------- whole engine
def make_prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 400, size=SHARED_PREFIX).tolist()
    return [prefix + rng.integers(3, 400, size=n - SHARED_PREFIX).tolist()
            if n > SHARED_PREFIX else rng.integers(3, 400, size=n).tolist()
            for n in PROMPT_LENS]


PARAMS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                        logprobs=3)

CASES = {
    "llama": ("llama", {}, "none"),
    "qwen2-replicated-kv": ("qwen2", {"num_key_value_heads": 1}, "none"),
    "qwen3-tied-padded-vocab": ("qwen3", {"vocab_size": 511, "tie_word_embeddings": True},
                                "none"),
    "qwen3_moe": ("qwen3_moe", {}, "none"),
    "qwen3_moe-expert-parallel": ("qwen3_moe", {}, "none"),
    "llama-int4": ("llama", {}, "int4"),
    # 5 local (window 20) : 1 global layers: six KV groups, each rank its heads of each.
    "gemma3-sliding-window": ("gemma3", {"tie_word_embeddings": True}, "none"),
    # A GGUF file as llama.cpp writes Phi-4-mini (fused qkv / gate_up, LongRoPE factors,
    # a window): with TP each rank loads its rows of each fused piece. transformers reads
    # the file without its factors and window, so TP=2 is compared with TP=1 only.
    "phi3-gguf": ("gguf", {"file": "tiny-phi4-longrope-F32.gguf"}, "auto"),
}
GGUF_FIXTURES = Path(__file__).parents[1] / "data" / "gguf"
# Gemma 3's six groups need more block ids for the same requests (an id is one layer's
# block): 36 hold the longest request (7 full + 5 windows of <= 5) but not all six. In a
# pool this small the blocks that slid out of the windows are evicted before the second
# pass comes back to them, so it hits no prefix: prefix hits over KV groups are tested
# in tests/engine/test_model_families.py.
NUM_BLOCKS = {"gemma3-sliding-window": 36}
NO_PREFIX_HIT = {"gemma3-sliding-window"}


def run_engine(model_dir, quantization: str, tensor_parallel_size: int, prompts,
               num_blocks: int = 10,
               enable_expert_parallel: bool = False):
    """Two passes over `prompts` (the second hits the prefix cache); outputs and the
    number of preemptions seen."""
    # 10 blocks of 16 tokens: the longest request (112 tokens) fits, all six do not.
    with LLM(str(model_dir), dtype="float32", quantization=quantization, max_model_len=256,
             max_num_batched_tokens=32, num_gpu_blocks_override=num_blocks,
             tensor_parallel_size=tensor_parallel_size,
             enable_expert_parallel=enable_expert_parallel) as llm:
        preemptions = count_preemptions(llm)
        first = llm.generate(prompts, PARAMS, use_tqdm=False)
        second = llm.generate(prompts, PARAMS, use_tqdm=False)
    return first, second, preemptions[0]


# Long (two engines, each spawning ranks, over a GGUF conversion): with the extended tests.
EXTENDED = {"phi3-gguf"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.extended)
                                  if c in EXTENDED else c for c in CASES])
def test_tp2_matches_tp1_and_transformers(case, tmp_path):
    arch, overrides, quantization = CASES[case]
    if arch == "gguf":
        model_dir = GGUF_FIXTURES / overrides["file"]
    else:
        model_dir = build_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    prompts = make_prompts()
    num_blocks = NUM_BLOCKS.get(case, 10)
    one = run_engine(model_dir, quantization, 1, prompts, num_blocks)
    two = run_engine(model_dir, quantization, 2, prompts, num_blocks,
                     enable_expert_parallel=case.endswith("expert-parallel"))

    assert two[2] > 0, "the case was meant to preempt"
    assert case in NO_PREFIX_HIT or any(o.num_cached_tokens > 0 for o in two[1]), \
        "the second pass hit no prefix"
    for run_one, run_two in zip(one[:2], two[:2], strict=True):
        for a, b in zip(run_one, run_two, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            for lp_a, lp_b in zip(a.outputs[0].logprobs.logprobs,
                                  b.outputs[0].logprobs.logprobs, strict=True):
                assert np.allclose(lp_a, lp_b, atol=1e-3), (lp_a, lp_b)
    if quantization == "none" and arch != "gguf":
        ref = hf_greedy_reference(model_dir, prompts, NUM_NEW_TOKENS, ignore_eos=True)
        for run in two[:2]:
            assert_greedy_matches([o.outputs[0].token_ids for o in run], ref)


def test_tp3_matches_tp1(tmp_path):
    """3 ranks over 6 query heads and 3 KV heads (one each): TP=1's greedy tokens, and the
    same KV block count from the same host budget (each rank a third of it, a third of the
    KV heads)."""
    model_dir = build_tiny_checkpoint(tmp_path / "llama", "llama", num_attention_heads=6,
                                      num_key_value_heads=3, head_dim=16, hidden_size=96,
                                      intermediate_size=192)
    prompts = make_prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory="3M",
             tensor_parallel_size=3) as llm:
        three = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # The KV budget is the node's, split over the ranks; each holds 1 of 3 KV heads,
        # so the block count equals one rank holding all heads with the whole budget.
        num_blocks_three = llm.engine_core.kv_cache_info.num_blocks
    with LLM(str(model_dir), dtype="float32", max_model_len=256, kv_cache_memory="3M") as llm:
        one = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine_core.kv_cache_info.num_blocks == num_blocks_three
    assert three == one


def test_bad_size_fails_before_starting_workers(tmp_path):
    model_dir = build_tiny_checkpoint(tmp_path / "llama", "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: .*attention heads"):
        LLM(str(model_dir), dtype="float32", max_model_len=256, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


def test_sharded_linears_keep_their_shapes():
    """A rank builds only its shard (no process group needed to construct one)."""
    from engine.distributed.parallel_state import set_tp_group_for_tests
    from engine.models.registry import get_model_class

    config = tiny_config("qwen3_moe", vocab_size=511)
    try:
        set_tp_group_for_tests(1, 2)
        with torch.device("meta"):
            model = get_model_class(config)(config)
    finally:
        set_tp_group_for_tests(0, 1)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert attn.qkv_proj.weight.shape == (2 * 16 + 2 * 16, 64)
    assert attn.o_proj.weight.shape == (64, 32)
    assert model.model.embed_tokens.weight.shape == (256, 64)  # 511 rows -> 2 x 256
    assert model.model.embed_tokens.vocab_rows == RowRange(256, 255)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 32, 64) and experts.down_proj.shape == (8, 64, 16)


def test_expert_parallel_ranks_sum_to_the_whole_block():
    """Expert parallel: rank r of 2 holds experts [4r, 4r + 4) whole, loaded from either
    checkpoint layout, and the two ranks' outputs add up to one rank's (the all-reduce)."""
    from engine.distributed.parallel_state import set_tp_group_for_tests
    from engine.models.moe import FusedExperts

    torch.manual_seed(0)
    num_experts, hidden, inter, tokens, top_k = 8, 16, 12, 10, 2
    gate_up = torch.randn(num_experts, 2 * inter, hidden)
    down = torch.randn(num_experts, hidden, inter)
    x = torch.randn(tokens, hidden)
    topk_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, top_k)

    def build(rank: int, size: int, expert_parallel: bool, per_expert: bool) -> FusedExperts:
        try:
            set_tp_group_for_tests(rank, size, expert_parallel)
            layer = FusedExperts(num_experts, hidden, inter)
        finally:
            set_tp_group_for_tests(0, 1)
        if per_expert:  # one tensor per expert and projection, as HF checkpoints store them
            filled = 0
            for e in range(num_experts):
                filled += layer.load_shard("gate_up_proj", gate_up[e, :inter], (e, 0))
                filled += layer.load_shard("gate_up_proj", gate_up[e, inter:], (e, 1))
                filled += layer.load_shard("down_proj", down[e], (e, 0))
            assert filled == layer.gate_up_proj.numel() + layer.down_proj.numel()
        else:
            layer.load_shard("gate_up_proj", gate_up, None)
            layer.load_shard("down_proj", down, None)
        return layer

    whole = build(0, 1, False, False)(x, topk_ids, topk_weights)
    for per_expert in (False, True):
        ranks = [build(rank, 2, True, per_expert) for rank in range(2)]
        assert [(r.experts.start, r.experts.size) for r in ranks] == [(0, 4), (4, 4)]
        assert ranks[1].gate_up_proj.shape == (4, 2 * inter, hidden)
        assert torch.equal(ranks[1].down_proj[0], down[4])
        parts = [r(x, topk_ids, topk_weights) for r in ranks]
        assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)
        assert not torch.equal(parts[0], whole)  # each rank really computed only its share


def test_a_rank_that_cannot_start_fails_start_up_in_one_line(tmp_path):
    """Port in use: rank 0 cannot host the process group's store."""
    import socket

    from engine.config import EngineConfig, ModelConfig, ParallelConfig
    from engine.core.core import EngineCore

    model_dir = build_tiny_checkpoint(tmp_path / "llama", "llama")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = EngineConfig(
            model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=128),
            parallel_config=ParallelConfig(tensor_parallel_size=2,
                                           master_port=busy.getsockname()[1]))
        with pytest.raises(RuntimeError) as info:
            EngineCore(config)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("tensor-parallel rank 0 failed to start: "), message


def test_ranks_get_the_starters_environment(monkeypatch):
    """A forkserver keeps the environment of its start; each rank applies the starter's."""
    import os

    from engine.executor.worker_proc import apply_env, env_snapshot

    monkeypatch.setenv("PAGEDSERVE_QUANT_MAX_ROWS", "3")
    snapshot = env_snapshot()
    monkeypatch.setenv("PAGEDSERVE_QUANT_MAX_ROWS", "7")
    monkeypatch.setenv("PAGEDSERVE_STALE_SETTING", "1")
    apply_env(snapshot)
    assert os.environ["PAGEDSERVE_QUANT_MAX_ROWS"] == "3"
    assert "PAGEDSERVE_STALE_SETTING" not in os.environ
