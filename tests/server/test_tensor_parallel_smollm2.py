"""The real SmolLM2-135M (9 attention heads, 3 KV heads) under tensor parallelism.

TP=2 cannot split 9 heads: start-up fails with one line naming the heads, before any
worker starts. TP=3 (three ranks, one thread each; on a 2-core machine one core is
shared) gives the same greedy tokens as one rank. The GGUF's Q4_1 linears are
quantized again per shard; every shard boundary falls on a group of 32 columns
(o_proj 576 / 3 = 192, down_proj 1536 / 3 = 512), so each rank holds exactly its part
of the one-rank integers.
"""

from __future__ import annotations

import multiprocessing

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "List three primary colors."]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16)


def test_tp2_fails_at_start_up_with_one_line():
    # Children of other tests (a session-wide server's engine core) may be alive: only
    # the ones this start made must be gone.
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError) as info:
        LLM(dtype="float32", max_model_len=256, kv_cache_memory="32M", tensor_parallel_size=2)
    message = str(info.value)
    assert "\n" not in message
    assert "--tensor-parallel-size 2" in message and "9 attention heads" in message, message
    assert not set(multiprocessing.active_children()) - before


@pytest.mark.extended
def test_tp3_greedy_tokens_equal_tp1():
    def run(size: int) -> list[list[int]]:
        with LLM(dtype="float32", max_model_len=256, kv_cache_memory="32M",
                 tensor_parallel_size=size) as llm:
            prompts = [llm.apply_chat_template([{"role": "user", "content": text}])
                       for text in PROMPTS]
            return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS,
                                                                  use_tqdm=False)]

    one = run(1)
    assert run(3) == one
    assert not multiprocessing.active_children()
