"""LoRA adapters against transformers + peft on the same weights (issue 44).

A tiny random Llama and four random adapters (ranks 2-16, different target modules, one
rsLoRA); prompts of the four adapters and of the base interleaved in one batch, under
prefix hits, chunked prefill and preemption, with fewer adapter slots than adapters.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.lora_request import LoRARequest
from engine.request import EngineCoreRequest
from engine.structured_output import StructuredOutputsParams
from engine.xray_schema import XrayLimits
from tests.support.correctness import count_preemptions
from tests.support.hf_reference import assert_greedy_matches
from tests.support.lora_fixtures import ADAPTER_SPECS, build_adapter, peft_greedy_reference
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.spec_decode import SpecCounts

NUM_NEW = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
NAMES = [*ADAPTER_SPECS, None]  # None: the base


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_checkpoint(root / "base", "llama", max_position_embeddings=512)
    adapters = {name: build_adapter(base, root, name, seed=i)
                for i, name in enumerate(ADAPTER_SPECS)}
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, 500, size=40).tolist()  # shared by every prompt
    prompts = [prefix + rng.integers(3, 500, size=n).tolist() for n in (3, 70, 25, 150, 9)]
    refs = {name: peft_greedy_reference(base, adapters.get(name), prompts, NUM_NEW)
            for name in NAMES}
    return base, adapters, prompts, refs


def lora_requests(adapters) -> dict[str | None, LoRARequest | None]:
    out: dict[str | None, LoRARequest | None] = {None: None}
    for i, (name, path) in enumerate(adapters.items(), start=1):
        out[name] = LoRARequest(name, i, str(path))
    return out


def run_mixed(llm: LLM, prompts, adapters):
    """Every prompt under every adapter and the base, interleaved in one generate()."""
    requests = lora_requests(adapters)
    jobs = [(name, p) for p in range(len(prompts)) for name in NAMES]
    outs = llm.generate([prompts[p] for _, p in jobs], GREEDY, use_tqdm=False,
                        lora_request=[requests[name] for name, _ in jobs])
    by_name: dict[str | None, list[list[int]]] = {name: [None] * len(prompts) for name in NAMES}
    cached: dict[str | None, list[int]] = {name: [0] * len(prompts) for name in NAMES}
    for (name, p), out in zip(jobs, outs, strict=True):
        by_name[name][p] = out.outputs[0].token_ids
        cached[name][p] = out.num_cached_tokens
    return by_name, cached


def test_adapters_and_base_in_one_batch_match_peft(case):
    base, adapters, prompts, refs = case
    llm = LLM(base, dtype="float32", max_model_len=512, enable_lora=True, max_loras=4,
              max_cpu_loras=4)
    ours, _ = run_mixed(llm, prompts, adapters)
    for name in NAMES:
        assert_greedy_matches(ours[name], refs[name])
    # The adapters change the answers: no adapter's tokens are the base's.
    for name in ADAPTER_SPECS:
        assert ours[name] != ours[None], name


def test_prefix_hits_chunks_preemption_and_two_slots(case):
    """Two adapter slots for four adapters, 64-token steps, a KV cache too small for
    everything at once; run twice so the second run hits the prefix cache."""
    base, adapters, prompts, refs = case
    llm = LLM(base, dtype="float32", max_model_len=512, enable_lora=True, max_loras=2,
              max_cpu_loras=3, max_num_batched_tokens=64, num_gpu_blocks_override=30)
    preemptions = count_preemptions(llm)
    for _ in range(2):
        ours, cached = run_mixed(llm, prompts, adapters)
        for name in NAMES:
            assert_greedy_matches(ours[name], refs[name])
    assert preemptions[0] > 0
    assert any(c > 0 for c in cached[None]) and any(c > 0 for c in cached["b8"])
    assert llm.engine_core.scheduler.kv_cache_manager.usage == 0


def test_ngram_speculation_and_json_under_adapters(case):
    """Speculation's verify rows run under their request's adapter (the draft is the
    prompt's n-grams, whichever adapter): the greedy tokens stay peft's. A grammar
    constrains an adapter's output as it does the base's."""
    base, adapters, _, _ = case
    # Prompts that repeat a pattern, so the n-gram drafter has something to propose.
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 500, size=n).tolist() * 5 for n in (4, 7, 11)]
    refs = {name: peft_greedy_reference(base, adapters.get(name), prompts, NUM_NEW)
            for name in NAMES}
    llm = LLM(base, dtype="float32", max_model_len=512, enable_lora=True, max_loras=4,
              max_cpu_loras=4, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4, "disable_by_batch_size": 64})
    counts = SpecCounts(llm)
    ours, _ = run_mixed(llm, prompts, adapters)
    for name in NAMES:
        assert_greedy_matches(ours[name], refs[name])
    assert counts.draft_tokens > 0
    json_params = SamplingParams(temperature=0.0, max_tokens=24,
                                 structured_outputs=StructuredOutputsParams("json_object"))
    out = llm.generate([prompts[0]], json_params, use_tqdm=False,
                       lora_request=lora_requests(adapters)["b8"])[0].outputs[0]
    assert out.text.lstrip().startswith("{")


def test_the_same_prompt_under_two_adapters_shares_no_block(case):
    base, adapters, prompts, _ = case
    llm = LLM(base, dtype="float32", max_model_len=512, enable_lora=True, max_loras=2)
    requests = lora_requests(adapters)
    llm.generate([prompts[3]], GREEDY, use_tqdm=False, lora_request=requests["a4"])
    other = llm.generate([prompts[3]], GREEDY, use_tqdm=False, lora_request=requests["b8"])
    base_out = llm.generate([prompts[3]], GREEDY, use_tqdm=False)
    same = llm.generate([prompts[3]], GREEDY, use_tqdm=False, lora_request=requests["a4"])
    assert other[0].num_cached_tokens == 0 and base_out[0].num_cached_tokens == 0
    assert same[0].num_cached_tokens > 0
    # The x-ray names each request's adapter.
    core = llm.engine_core
    core.add_request(EngineCoreRequest("under-b8", prompts[0], GREEDY,
                                       lora_request=requests["b8"]))
    core.add_request(EngineCoreRequest("base", prompts[1], GREEDY))
    snapshot = core.xray_snapshot(XrayLimits())
    assert {r.req_id: r.lora_name for r in [*snapshot.running, *snapshot.waiting]} == \
        {"under-b8": "b8", "base": None}
    while core.has_unfinished_requests():
        core.step()


def test_an_adapter_over_the_rank_limit_is_refused(case):
    base, adapters, prompts, _ = case
    llm = LLM(base, dtype="float32", max_model_len=512, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16 is over --max-lora-rank 8"):
        llm.generate([prompts[0]], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("c16", 1, str(adapters["c16"])))
    with pytest.raises(ValueError, match="does not run with --tensor-parallel-size > 1"):
        EngineConfig.from_options(str(base), enable_lora=True, tensor_parallel_size=2)
    without = LLM(base, dtype="float32", max_model_len=512)
    with pytest.raises(ValueError, match="enable_lora"):
        without.generate([prompts[0]], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest("a4", 1, str(adapters["a4"])))
