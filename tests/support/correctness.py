"""Engine-correctness helpers: prompts, the greedy comparison with transformers, preemptions.

Shared by tests/engine/test_correctness.py, test_decode_graphs.py, test_tensor_parallel.py
and tests/gpu/test_gpu_parity.py.
"""

from __future__ import annotations

import numpy as np

from engine import LLM, SamplingParams
from tests.support.hf_reference import Reference, assert_greedy_matches, hf_greedy_reference

PROMPT_LENS = [5, 17, 300, 40, 120, 9, 250, 64]


NUM_NEW_TOKENS = 32


def make_prompts(seed: int, shared_prefix_len: int = 0) -> list[list[int]]:
    """Random prompts of PROMPT_LENS; with a prefix, those longer than it share it."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 500, size=shared_prefix_len).tolist()
    return [prefix + rng.integers(3, 500, size=n - shared_prefix_len).tolist()
            if n > shared_prefix_len else rng.integers(3, 500, size=n).tolist()
            for n in PROMPT_LENS]


def hf_reference(model_dir, prompts):
    return hf_greedy_reference(model_dir, prompts, NUM_NEW_TOKENS, ignore_eos=True)


def assert_matches(ours: list[list[int]], ref: Reference) -> None:
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in ours)
    assert_greedy_matches(ours, ref)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def generate_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def count_preemptions(llm: LLM) -> list[int]:
    """Wrap the engine's step to total the preemptions it reports."""
    total = [0]
    original = llm.engine_core.step

    def step():
        outputs = original()
        total[0] += outputs.scheduler_stats.num_preemptions
        return outputs

    llm.engine_core.step = step
    return total


def assert_all_three_match(llm: LLM, shared, shared_ref: Reference) -> None:
    """Two runs of the shared-prefix prompts on an engine built to chunk and preempt:
    both match the reference, preemptions happened, the second run hit the prefix cache,
    and every block is free afterwards."""
    preemptions = count_preemptions(llm)
    assert_matches(generate_ids(llm, shared), shared_ref)
    second = llm.generate(shared, GREEDY, use_tqdm=False)
    assert_matches([o.outputs[0].token_ids for o in second], shared_ref)
    assert preemptions[0] > 0
    assert any(o.num_cached_tokens > 0 for o in second)
    assert llm.engine_core.scheduler.kv_cache_manager.usage == 0
