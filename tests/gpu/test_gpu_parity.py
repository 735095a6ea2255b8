"""Greedy parity with transformers on CUDA: bf16 and fp16, each CUDA backend, with and
without decode CUDA graphs, under prefix hits, chunked prefill and preemption.

The scenarios and the near-tie rule are tests/engine/test_correctness.py's (fp32 on CPU);
here the engine runs in half precision on the GPU and transformers stays the fp32
CPU reference, so a flipped token must also be a tie in numbers: transformers'
logprob of its own token exceeds its logprob of ours by at most MAX_GAP.
Skipped without CUDA (marked gpu); benchmarks/gpu_check.sh runs them.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import LLM
from tests.support.correctness import (
    GREEDY,
    NUM_NEW_TOKENS,
    count_preemptions,
    generate_ids,
    hf_reference,
    make_prompts,
)
from tests.support.hf_reference import assert_greedy_matches
from tests.support.model_fixtures import build_tiny_checkpoint

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
MAX_GAP = {"bfloat16": 1.0, "float16": 0.5}
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
BACKENDS = [
    pytest.param("triton", 16, id="triton-16"),
    pytest.param("flash_attn", 256, id="flash_attn-256", marks=pytest.mark.skipif(
        not HAS_FLASH_ATTN, reason="flash-attn is not installed")),
]
MAX_MODEL_LEN = 512
# KV for the longest request (332 tokens) but not for all eight: preemption.
PREEMPTING_BLOCKS = {16: 24, 256: 2}


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tmp_path_factory):
    """A tiny checkpoint, plain and shared-prefix prompts, transformers' fp32 tokens."""
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param,
                                      max_position_embeddings=MAX_MODEL_LEN)
    prompts = make_prompts(seed=1)
    shared = make_prompts(seed=2, shared_prefix_len=48)
    return request.param, model_dir, prompts, hf_reference(model_dir, prompts), shared, \
        hf_reference(model_dir, shared)


def check(ours: list[list[int]], ref, dtype: str) -> int:
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in ours)
    return assert_greedy_matches(ours, ref, max_gap=MAX_GAP[dtype])


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize(("backend", "block_size"), BACKENDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_greedy_parity_on_cuda(arch_case, dtype, backend, block_size, enforce_eager):
    arch, model_dir, prompts, ref, shared, shared_ref = arch_case
    common = dict(dtype=dtype, device="cuda", attention_backend=backend, block_size=block_size,
                  max_model_len=MAX_MODEL_LEN, max_num_seqs=16, enforce_eager=enforce_eager)

    # One batch of eight: decode steps of 8 down to 1 request (padded to 8, 4, 2, 1).
    llm = LLM(model_dir, num_gpu_blocks_override=4096 // block_size, **common)
    runner = llm.engine_core.executor.runner
    assert runner.backend.name == backend
    flips = check(generate_ids(llm, prompts), ref, dtype)
    graphs = runner.decode_graphs
    if enforce_eager:
        assert graphs is None
    elif arch == "qwen3_moe":
        pass  # the MoE layer reads expert counts on the host: capture falls back to eager
    else:
        assert graphs is not None and graphs.graphs, "no decode graph was captured"
        assert graphs.num_replays > 0
    llm.shutdown()

    # Prefix hits, chunked prefill and preemption at once.
    llm = LLM(model_dir, max_num_batched_tokens=64,
              num_gpu_blocks_override=PREEMPTING_BLOCKS[block_size],
              **common)
    preemptions = count_preemptions(llm)
    flips += check(generate_ids(llm, shared), shared_ref, dtype)
    second = llm.generate(shared, GREEDY, use_tqdm=False)
    flips += check([o.outputs[0].token_ids for o in second], shared_ref, dtype)
    assert preemptions[0] > 0
    assert any(o.num_cached_tokens > 0 for o in second)
    llm.shutdown()
    print(f"{arch} {dtype} {backend} {'eager' if enforce_eager else 'graphs'}: "
          f"{flips} of 24 sequences ended at a near-tie flip")


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_greedy_parity_with_an_fp8_kv_cache_on_cuda(arch_case, enforce_eager):
    """--kv-cache-dtype fp8 (rows of float8 e4m3 and a scale each, the Triton backend):
    bfloat16 greedy tokens against transformers' fp32 under the near-tie rule, in a batch of
    eight and under prefix hits, chunked prefill and preemption."""
    arch, model_dir, prompts, ref, shared, shared_ref = arch_case
    common = dict(dtype="bfloat16", device="cuda", attention_backend="triton", block_size=16,
                  max_model_len=MAX_MODEL_LEN, max_num_seqs=16, enforce_eager=enforce_eager,
                  kv_cache_dtype="fp8")
    llm = LLM(model_dir, num_gpu_blocks_override=4096 // 16, **common)
    caches = llm.engine_core.executor.runner.kv_caches
    assert caches and all(c.dtype == torch.float8_e4m3fn for c in caches)
    flips = check(generate_ids(llm, prompts), ref, "bfloat16")
    llm.shutdown()
    llm = LLM(model_dir, max_num_batched_tokens=64, num_gpu_blocks_override=PREEMPTING_BLOCKS[16],
              **common)
    preemptions = count_preemptions(llm)
    flips += check(generate_ids(llm, shared), shared_ref, "bfloat16")
    assert preemptions[0] > 0
    llm.shutdown()
    print(f"{arch} fp8 KV {'eager' if enforce_eager else 'graphs'}: {flips} of 16 sequences "
          f"ended at a near-tie flip")
