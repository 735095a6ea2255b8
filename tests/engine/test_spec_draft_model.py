"""Speculative decoding with a draft model (`method: draft_model`): a second model with
its own paged KV (the target's block ids) proposes greedily; greedy outputs equal the
target's alone, token for token, under prefix hits, chunked prefill, preemption, async
scheduling and aborts, with no KV block leaks.

Two drafts of the tiny random Llama target: the target itself (every draft is the
target's argmax, so every draft is accepted: this fails if the draft's KV misses any
token the target computed, e.g. on a prefix-cache hit or after a preemption) and the
target cut to its first layer (accepts some drafts, rejects most: rollbacks run).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.request import EngineCoreRequest
from tests.support.correctness import count_preemptions, make_prompts
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.spec_decode import SpecCounts, assert_all_blocks_free, note_steps_in_flight

K = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# Chunked prefill (64-token budget), prefix hits (prompts share 48 tokens), preemption
# (24 blocks of 16 tokens hold the longest request, not all eight).
HARD = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=64,
            num_gpu_blocks_override=24)


def spec(draft) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama",
                                 max_position_embeddings=512)


@pytest.fixture(scope="module")
def one_layer_draft(target, tmp_path_factory):
    """The target's embedding, first layer, final norm and head: a worse, related model."""
    draft = tmp_path_factory.mktemp("draft")
    shutil.copytree(target, draft, dirs_exist_ok=True)
    weights = load_file(target / "model.safetensors")
    save_file({name: w for name, w in weights.items() if not name.startswith("model.layers.1.")},
              draft / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    return draft


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(seed=2, shared_prefix_len=48)


@pytest.fixture(scope="module")
def reference(target, prompts):
    """The target alone (HARD settings): its greedy tokens by prompt."""
    outputs = LLM(target, **HARD).generate(prompts, GREEDY, use_tqdm=False)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)}


def assert_equals_reference(outputs, prompts, reference) -> None:
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference[tuple(prompt)]


def test_target_as_its_own_draft_accepts_every_draft(target, prompts, reference):
    llm = LLM(target, speculative_config=spec(target), **HARD)
    counts, preemptions = SpecCounts(llm), count_preemptions(llm)
    draft_model = llm.engine_core.executor.runner.draft_model
    for _ in range(2):  # the second round hits the prefix cache of the first
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_equals_reference(outputs, prompts, reference)
    assert outputs[-1].num_cached_tokens > 0
    assert preemptions[0] > 0
    assert counts.draft_tokens > 0
    assert counts.accepted == counts.draft_tokens  # the draft's KV saw every token
    assert draft_model.num_forwards > 0
    # Steps without drafts (prefill chunks, more than disable_by_batch_size running) ran
    # no shadow pass; requests caught up before drafting, prefix hits from position 0.
    assert draft_model.num_skipped_shadows > 0 and draft_model.num_caught_up_tokens > 0
    assert_all_blocks_free(llm)


def test_paused_drafting_skips_the_shadow_pass(target, one_layer_draft, prompts, reference):
    """While the back-off pauses every request, steps run no draft forward at all; a
    request that drafts again first catches its draft K/V up."""
    config = {**spec(one_layer_draft), "min_acceptance_rate": 0.95,
              "backoff_min_draft_tokens": 4, "backoff_tokens": 12}
    llm = LLM(target, speculative_config=config, dtype="float32", max_model_len=512)
    draft_model = llm.engine_core.executor.runner.draft_model
    counts = SpecCounts(llm)
    some = prompts[:2]
    outputs = llm.generate(some, GREEDY, use_tqdm=False)
    assert_equals_reference(outputs, some, reference)
    assert counts.draft_tokens > counts.accepted
    skipped, caught_up = draft_model.num_skipped_shadows, draft_model.num_caught_up_tokens
    assert skipped >= 10 and caught_up >= 10  # paused stretches of 12 tokens, then back
    assert_all_blocks_free(llm)


def test_one_layer_draft_rejections_roll_back(target, one_layer_draft, prompts, reference):
    llm = LLM(target, speculative_config=spec(one_layer_draft), **HARD)
    counts, preemptions = SpecCounts(llm), count_preemptions(llm)
    for _ in range(2):
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert_equals_reference(outputs, prompts, reference)
    assert outputs[-1].num_cached_tokens > 0
    assert preemptions[0] > 0
    assert 0 < counts.accepted < counts.draft_tokens  # some drafts kept, some rolled back
    assert counts.rollbacks_freeing_blocks > 0
    assert_all_blocks_free(llm)


def test_async_scheduling_never_overlaps_a_drafting_step(target, one_layer_draft, prompts,
                                                          reference):
    """The core's rule for proposers (a step that may draft runs with nothing in
    flight) holds for the draft model too; overlapping steps carry no drafts (no shadow
    pass) and the catch-up keeps its KV whole."""
    llm = LLM(target, speculative_config={**spec(target), "disable_by_batch_size": 2},
              async_scheduling=True, **HARD)
    counts = SpecCounts(llm)
    scheduled = note_steps_in_flight(llm)
    assert_equals_reference(llm.generate(prompts, GREEDY, use_tqdm=False), prompts, reference)
    assert any(in_flight for in_flight, _ in scheduled)
    assert not any(in_flight and drafts for in_flight, drafts in scheduled)
    assert 0 < counts.accepted == counts.draft_tokens
    assert_all_blocks_free(llm)


def test_sampled_requests_and_aborts(target, prompts):
    """temperature > 0 verifies the greedy drafts with the one-hot rule (its
    distribution: tests/unit/sample/test_rejection.py): seeded outputs repeat, run to
    max_tokens; aborting requests mid-verification frees every block."""
    llm = LLM(target, speculative_config={**spec(target), "disable_by_batch_size": 6},
              dtype="float32", max_model_len=512)
    counts = SpecCounts(llm)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True,
                            n=2, seed=11)
    first = llm.generate(prompts[:3], params, use_tqdm=False)  # 6 requests
    second = llm.generate(prompts[:3], params, use_tqdm=False)
    for a, b in zip(first, second, strict=True):
        for sa, sb in zip(a.outputs, b.outputs, strict=True):
            assert sa.token_ids == sb.token_ids and len(sa.token_ids) == 24
    assert 0 < counts.accepted <= counts.draft_tokens
    assert_all_blocks_free(llm)

    core = llm.engine_core
    req_ids = [f"r{i}" for i in range(3)]
    for req_id, prompt in zip(req_ids, prompts[:3], strict=True):
        core.add_request(EngineCoreRequest(req_id, prompt, GREEDY))
    drafted_before = counts.draft_tokens
    while counts.draft_tokens < drafted_before + 3 * K:
        core.step()
    assert core.abort_requests(req_ids) == req_ids
    core.step()  # the runner forgets them
    assert_all_blocks_free(llm)
    assert core.executor.runner.requests == {}


def test_kv_budget_counts_the_draft_layers(target, one_layer_draft):
    """A block id is a block in every target layer and every draft layer: the same
    --kv-cache-memory holds fewer blocks with a draft model."""
    # One block: 2 (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 4 KiB per layer.
    layer_block_bytes = 2 * 16 * 2 * 16 * 4
    budget = 100 * 3 * layer_block_bytes
    plain = LLM(target, dtype="float32", kv_cache_memory=str(budget))
    with_draft = LLM(target, dtype="float32", kv_cache_memory=str(budget),
                     speculative_config=spec(one_layer_draft))
    num_blocks = with_draft.engine_core.kv_cache_info.num_blocks
    assert plain.engine_core.kv_cache_info.num_blocks == 150 - 1  # 2 layers; the padding block
    assert num_blocks == 100 - 1  # 2 + 1 layers
    (layer,) = with_draft.engine_core.executor.runner.draft_model.attention_layers
    assert layer.kv_cache.numel() * 4 == (num_blocks + 1) * layer_block_bytes


def test_target_with_sliding_window_groups(tmp_path, target, prompts):
    """Gemma 3 (several KV-cache groups): the draft reads group 0's (full-attention)
    blocks; a Llama with the same tokenizer drafts, the tokens stay the target's."""
    gemma = build_tiny_checkpoint(tmp_path / "gemma3", "gemma3", max_position_embeddings=512)
    settings = {**HARD, "num_gpu_blocks_override": 120}
    chosen = prompts[:3]
    want = [o.outputs[0].token_ids for o in LLM(gemma, **settings).generate(
        chosen, GREEDY, use_tqdm=False)]
    llm = LLM(gemma, speculative_config=spec(target), **settings)
    assert llm.engine_core.scheduler.kv_cache_manager.num_groups > 1
    counts = SpecCounts(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(chosen, GREEDY, use_tqdm=False)]
    assert got == want
    assert counts.draft_tokens > 0
    assert_all_blocks_free(llm)


# ------------------------------------------------------------------ configuration errors
def test_draft_model_needs_a_model():
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="takes none"):
        SpeculativeConfig.from_dict({"method": "ngram", "model": "/somewhere"})


def test_missing_draft_checkpoint(tmp_path, target):
    with pytest.raises(ValueError, match="speculative_config model .*no such file"):
        LLM(target, dtype="float32", speculative_config=spec(tmp_path / "nowhere"))


def test_tensor_parallel_ranks_run_the_whole_draft(target, one_layer_draft, prompts,
                                                   reference):
    """TP=2: each rank holds the whole draft model (a group of one inside it) and keeps
    rank 0's drafts. The target as its own draft is accepted wherever the sharded target
    and the whole draft agree (all but near-ties); the one-layer draft rolls back."""
    some = prompts[:4]
    for draft in (target, one_layer_draft):
        with LLM(target, speculative_config=spec(draft), tensor_parallel_size=2,
                 **HARD) as llm:
            counts = SpecCounts(llm)
            outputs = llm.generate(some, GREEDY, use_tqdm=False)
            assert_all_blocks_free(llm)
        assert_equals_reference(outputs, some, reference)
        if draft == target:
            assert counts.accepted >= 0.9 * counts.draft_tokens > 0
        else:
            assert 0 < counts.draft_tokens - counts.accepted


def test_each_rank_loads_the_whole_draft(target, one_layer_draft):
    """As rank 0 of 2, the draft model is built whole (no shards: it then runs without
    collectives) and the rank's group is its own again after."""
    import torch

    from engine.distributed.parallel_state import get_tp_group, set_tp_group_for_tests
    from engine.model_loader import load_model
    from engine.worker.draft_model import load_draft_model

    config = SpeculativeConfig.from_dict(spec(one_layer_draft))
    set_tp_group_for_tests(0, 2)
    try:
        draft = load_draft_model(config, str(target), 512, torch.float32, torch.device("cpu"),
                                 "none", 16, "auto")
        assert get_tp_group().size == 2
        sharded = load_model(one_layer_draft, torch.float32, "cpu", "none")
    finally:
        set_tp_group_for_tests(0, 1)
    whole = load_model(one_layer_draft, torch.float32, "cpu", "none")
    shapes = {name: p.shape for name, p in whole.named_parameters()}
    assert {name: p.shape for name, p in draft.model.named_parameters()} == shapes
    assert {name: p.shape for name, p in sharded.named_parameters()} != shapes


def test_target_with_only_sliding_window_layers_is_refused(tmp_path, target):
    """The draft reads KV-cache group 0's blocks; a sliding-window group drops old ones."""
    mistral = build_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=32,
                                    max_position_embeddings=512)
    with pytest.raises(ValueError, match="full-attention layers"):
        LLM(mistral, dtype="float32", speculative_config=spec(target))


@pytest.mark.parametrize("change, message", [
    ("extra_token", "tokenizer differs"),
    ("other_eos", "EOS token id"),
])
def test_draft_with_another_tokenizer_is_refused(tmp_path, target, change, message):
    from transformers import AutoTokenizer

    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    tokenizer = AutoTokenizer.from_pretrained(draft)
    if change == "extra_token":
        tokenizer.add_tokens(["<|draft_only|>"])
    else:
        tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(draft)
    with pytest.raises(ValueError, match=message):
        LLM(target, dtype="float32", speculative_config=spec(draft))


def test_draft_tokens_are_the_draft_models_greedy_continuation(target, one_layer_draft):
    """What the one-layer draft proposes is its own greedy continuation (run alone)."""
    prompt = np.random.default_rng(9).integers(3, 400, size=20).tolist()
    alone = LLM(one_layer_draft, dtype="float32", max_model_len=512)
    llm = LLM(target, dtype="float32", max_model_len=512,
              speculative_config=spec(one_layer_draft))
    runner = llm.engine_core.executor.runner
    proposed = []
    propose = runner.draft_model.propose

    def noting_propose(batch, num_drafts):
        drafts = propose(batch, num_drafts)
        proposed.append(drafts)
        return drafts

    runner.draft_model.propose = noting_propose
    target_first = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=K + 2,
                                                         ignore_eos=True), use_tqdm=False)
    # Step 1 prefills and samples the target's first token t0; step 2 drafts K tokens
    # after it: the draft model's greedy continuation of prompt + [t0].
    t0 = target_first[0].outputs[0].token_ids[0]
    continued = alone.generate([prompt + [t0]], SamplingParams(
        temperature=0.0, max_tokens=K, ignore_eos=True), use_tqdm=False)
    (first_draft,) = proposed[0].values()
    assert first_draft == continued[0].outputs[0].token_ids
