"""Greedy tokens and logprobs of the whole engine against Hugging Face transformers.

For each architecture a tiny random checkpoint is saved, then 8 prompts of mixed
lengths (5-300 tokens) are generated together, 32 greedy tokens each, and compared
token by token with `transformers` `generate` on the same weights (fp32). Where a
floating-point near-tie flips a token, our token must be in transformers' top-5 at
that step and the comparison of that sequence stops there (vLLM's rule).

Prefix hits, chunked prefill and preemption each have a test of their own on Llama
(the one to read when it fails); `test_all_three_at_once` runs all three together on
every architecture, so each architecture is covered without three more engines each.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.support.attention_cases import needs_kernels
from tests.support.correctness import (
    GREEDY,
    NUM_NEW_TOKENS,
    assert_all_three_match,
    assert_matches,
    count_preemptions,
    generate_ids,
    hf_reference,
    make_prompts,
)
from tests.support.hf_reference import Reference, assert_greedy_matches
from tests.support.model_fixtures import build_tiny_checkpoint

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
# One architecture for a test whose path does not depend on the model's layers.
LLAMA_ONLY = pytest.mark.parametrize("arch_case", ["llama"], indirect=True)








@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request, tmp_path_factory):
    arch = request.param
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp(arch), arch,
                                      max_position_embeddings=512)
    prompts = make_prompts(seed=1)
    shared = make_prompts(seed=2, shared_prefix_len=48)
    return model_dir, prompts, hf_reference(model_dir, prompts), shared, hf_reference(
        model_dir, shared)








def test_greedy_matches_transformers(arch_case):
    model_dir, prompts, ref, _, _ = arch_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512)
    assert_matches(generate_ids(llm, prompts), ref)


@LLAMA_ONLY
def test_prefix_cache_hits_match(arch_case):
    model_dir, _, _, shared, shared_ref = arch_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512)
    assert_matches(generate_ids(llm, shared), shared_ref)
    second = llm.generate(shared, GREEDY, use_tqdm=False)
    # Every prompt with a full block was seen in the first run.
    assert all(o.num_cached_tokens > 0 for o in second if len(o.prompt_token_ids) > 16)
    assert_matches([o.outputs[0].token_ids for o in second], shared_ref)


@LLAMA_ONLY
def test_chunked_prefill_matches(arch_case):
    model_dir, prompts, ref, _, _ = arch_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=64)
    assert_matches(generate_ids(llm, prompts), ref)


@LLAMA_ONLY
def test_preemption_matches(arch_case):
    model_dir, prompts, ref, _, _ = arch_case
    # 24 blocks of 16 tokens hold one longest request (332 tokens) but not all eight.
    llm = LLM(model_dir, dtype="float32", max_model_len=512, num_gpu_blocks_override=24)
    preemptions = count_preemptions(llm)
    assert_matches(generate_ids(llm, prompts), ref)
    assert preemptions[0] > 0




def test_all_three_at_once(arch_case):
    model_dir, _, _, shared, shared_ref = arch_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              num_gpu_blocks_override=24)
    assert_all_three_match(llm, shared, shared_ref)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "int8"])
@LLAMA_ONLY
def test_half_precision_kv_cache_matches(arch_case, kv_cache_dtype):
    """A float32 model over a float16 / bfloat16 / int8 KV cache (--kv-cache-dtype, CPU): the
    cache really holds that dtype, the decode kernel and the SDPA prefill read it, and greedy
    tokens match transformers under prefix hits, chunked prefill and preemption (near-tie
    rule: rounding keys and values may flip a near-tie)."""
    model_dir, _, _, shared, shared_ref = arch_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              num_gpu_blocks_override=24, kv_cache_dtype=kv_cache_dtype)
    caches = llm.engine_core.executor.runner.kv_caches
    assert caches and all(c.dtype == getattr(torch, kv_cache_dtype) for c in caches)
    assert_all_three_match(llm, shared, shared_ref)


@needs_kernels  # triton imported, under its interpreter where there is no GPU
@LLAMA_ONLY
def test_fp8_kv_cache_on_the_triton_path_matches(arch_case):
    """--kv-cache-dtype fp8 (the Triton backend, run here under the interpreter): the cache
    holds float8 e4m3 rows with a scale each, and greedy tokens match transformers under the
    near-tie rule; the CPU's torch backend refuses fp8 with a clear error."""
    model_dir, prompts, ref, _, _ = arch_case
    llm = LLM(model_dir, dtype="bfloat16", attention_backend="triton", kv_cache_dtype="fp8",
              max_model_len=512, num_gpu_blocks_override=64)
    caches = llm.engine_core.executor.runner.kv_caches
    assert caches and all(c.dtype == torch.float8_e4m3fn and c.shape[-1] == 16 + 4
                          for c in caches)  # the tiny llama's head_size 16 and the scale
    first = Reference(ref.token_ids[:3], ref.top5[:3], ref.logprobs[:3])
    # bfloat16 against fp32 transformers: a flip must be a tie in numbers (test_gpu_parity's gap)
    assert_greedy_matches(generate_ids(llm, prompts[:3]), first, max_gap=1.0)
    with pytest.raises(ValueError, match="fp8 needs the triton attention backend"):
        LLM(model_dir, dtype="bfloat16", kv_cache_dtype="fp8", max_model_len=512)


def test_kv_cache_dtype_choices():
    from engine.worker.kv_cache_init import resolve_kv_cache_dtype
    from server.http.cli import engine_config_from_args, make_arg_parser

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("float16", torch.float32, cpu) == torch.float16
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, cpu) == torch.int8
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_cache_dtype("int8", torch.bfloat16, cuda)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, cuda)
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, cuda) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="expected one of"):
        resolve_kv_cache_dtype("fp4", torch.float32, cpu)
    args = make_arg_parser().parse_args(["--kv-cache-dtype", "bfloat16"])
    assert engine_config_from_args(args, "/m", "m").cache_config.kv_cache_dtype == "bfloat16"


@pytest.mark.parametrize("arch_case", ["llama", "qwen3_moe"], indirect=True)
def test_async_scheduling_matches(arch_case):
    """Steps scheduled one ahead of the model: the same tokens under prefix hits, chunked
    prefill and preemption at once."""
    model_dir, _, _, shared, shared_ref = arch_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              num_gpu_blocks_override=24, async_scheduling=True)
    assert_all_three_match(llm, shared, shared_ref)


def test_async_scheduling_stops_like_sync(tmp_path):
    """max_tokens, stop tokens, min_tokens and stop strings end each sequence at the same
    token with and without async scheduling, and every block is free afterwards."""
    model_dir = build_tiny_checkpoint(tmp_path, "llama", max_position_embeddings=512)
    prompts = make_prompts(seed=3)
    free_run = LLM(model_dir, dtype="float32", max_model_len=512)
    reference = free_run.generate(prompts, GREEDY, use_tqdm=False)
    params = []
    for i, out in enumerate(reference):
        tokens, text = out.outputs[0].token_ids, out.outputs[0].text
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS,
                                         stop_token_ids=[tokens[5]]))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS,
                                         stop_token_ids=[tokens[2]], min_tokens=8))
        else:
            params.append(SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS,
                                         stop=[text[len(text) // 2:][:3]] if text else None))
    sync = free_run.generate(prompts, params, use_tqdm=False)
    ahead = LLM(model_dir, dtype="float32", max_model_len=512, async_scheduling=True)
    result = ahead.generate(prompts, params, use_tqdm=False)
    for s, a in zip(sync, result, strict=True):
        s_out, a_out = s.outputs[0], a.outputs[0]
        assert (a_out.token_ids, a_out.text, a_out.finish_reason, a_out.stop_reason) == (
            s_out.token_ids, s_out.text, s_out.finish_reason, s_out.stop_reason)
    assert {o.outputs[0].finish_reason for o in sync} == {"length", "stop"}
    assert ahead.engine_core.scheduler.kv_cache_manager.usage == 0
    assert not ahead.engine_core.has_unfinished_requests()


def test_logprobs_match_transformers(arch_case):
    model_dir, prompts, ref, _, _ = arch_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True,
                            logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, output in enumerate(outputs):
        sample = output.outputs[0]
        for step, token_id in enumerate(sample.token_ids):
            if token_id != ref.token_ids[i][step]:
                break  # past a near-tie flip the contexts differ
            row_ids, row_lps = sample.logprobs.token_ids[step], sample.logprobs.logprobs[step]
            assert row_ids[0] == token_id
            for tid, lp in zip(row_ids, row_lps, strict=True):
                assert abs(lp - float(ref.logprobs[i][step, tid])) < 1e-3
            assert len(row_ids) == 1 + 5


def test_seeded_sampling_independent_of_batch(tmp_path):
    model_dir = build_tiny_checkpoint(tmp_path, "llama", max_position_embeddings=512)
    llm = LLM(model_dir, dtype="float32", max_model_len=512)
    prompt = make_prompts(seed=3)[1]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24,
                            ignore_eos=True)
    alone = generate_ids(llm, [prompt], seeded)[0]
    others = make_prompts(seed=4) + make_prompts(seed=5)
    other_params = [SamplingParams(temperature=0.8, max_tokens=20 + i, ignore_eos=True)
                    for i in range(16)]
    outputs = llm.generate([*others[:8], prompt, *others[8:]],
                           [*other_params[:8], seeded, *other_params[8:]], use_tqdm=False)
    assert outputs[8].outputs[0].token_ids == alone
    again = generate_ids(llm, [prompt], seeded)[0]
    assert again == alone
