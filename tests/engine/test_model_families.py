"""Mistral, Phi-3 and Gemma 3 against transformers: greedy tokens on tiny random checkpoints,
with windows shorter than most prompts (5-300 tokens), under prefix hits, chunked prefill
and preemption at once (`assert_all_three_match`), near-tie rule as everywhere.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.support.correctness import assert_all_three_match, hf_reference, make_prompts
from tests.support.model_fixtures import build_tiny_checkpoint

# Windows that are not a multiple of the block size (16), so they start mid-block.
CASES = {
    # (Mistral without a window is the Llama decoder: test_models.py's prefill parity.)
    "mistral-window": ("mistral", dict(sliding_window=20)),
    # Phi-3 with LongRoPE: the short factors apply (the context does not outgrow the
    # original length), cos/sin scaled by the attention factor of `factor` 4; a partial
    # rotary dimension (Phi-4-mini's 0.75) and a window on every layer (Phi-3-mini-4k).
    "phi3-longrope": ("phi3", dict(
        max_position_embeddings=512, original_max_position_embeddings=512,
        rope_scaling={"rope_type": "longrope", "factor": 4.0,
                      "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [4.0 + i for i in range(6)]},
        partial_rotary_factor=0.75, sliding_window=36)),
    # Gemma 3: 5 local (window 20) : 1 global layers -> KV groups (1 full, 5 sliding).
    "gemma3": ("gemma3", dict(tie_word_embeddings=True)),
    # Gemma 2: local (window 20) and global layers alternating, attention soft-capped.
    "gemma2": ("gemma2", dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def family_case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    overrides = {"max_position_embeddings": 512, **overrides}
    model_dir = build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, **overrides)
    shared = make_prompts(seed=2, shared_prefix_len=48)
    return model_dir, shared, hf_reference(model_dir, shared)


def test_family_matches_transformers_under_prefix_hits_chunks_and_preemption(family_case):
    model_dir, shared, shared_ref = family_case
    # Small enough to preempt: 24 blocks hold the longest request (21 blocks) of a
    # one-group model; Gemma's 6 groups need 21 + 5 windows (<= 7 blocks each), and 110
    # keep enough freed window blocks cached for the second run's prefix hits.
    # One sliding group (Mistral, Phi-3 here) holds a window per request: fewer blocks.
    # Gemma 2 here: a sliding and a full group, of one layer each.
    llm = LLM(model_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              num_gpu_blocks_override=preempting_blocks(model_dir))
    assert_all_three_match(llm, shared, shared_ref)


def preempting_blocks(model_dir) -> int:
    return {"gemma3": 110, "gemma2": 36, "mistral-window": 16}.get(model_dir.name[:-1], 24)


@pytest.mark.parametrize("family_case", ["mistral-window", "gemma2"], indirect=True)
def test_int8_kv_cache_under_windows_and_softcaps(family_case):
    """The int8 KV cache where attention takes other paths: a sliding window (the kernel's
    first key, the windowed SDPA prefill, freed window blocks) and Gemma 2's logit softcap
    (decodes by SDPA over dequantized gathers): greedy tokens under the near-tie rule."""
    model_dir, shared, shared_ref = family_case
    llm = LLM(model_dir, dtype="float32", max_model_len=512, max_num_batched_tokens=64,
              num_gpu_blocks_override=preempting_blocks(model_dir), kv_cache_dtype="int8")
    assert all(c.dtype == torch.int8 for c in llm.engine_core.executor.runner.kv_caches)
    assert_all_three_match(llm, shared, shared_ref)
