"""Speculative decoding end to end: greedy tokens with drafts equal those without, token
for token, under prefix hits, chunked prefill and preemption; stops, logprobs, n > 1,
sampled requests, aborts; no KV block leaks. Then the real default model on copy-heavy
prompts, where n-gram drafts are accepted.

On the tiny random model the n-gram proposer rarely finds anything the model would say,
so most tests give the engine an oracle proposer: the plain run's own next tokens, with
one token of every third draft corrupted, so steps accept some drafts and reject others.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.request import EngineCoreRequest
from tests.support.correctness import count_preemptions, make_prompts
from tests.support.model_fixtures import build_tiny_checkpoint
from tests.support.spec_decode import SpecCounts, assert_all_blocks_free, note_steps_in_flight

K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# Chunked prefill (64-token budget), prefix hits (prompts share 48 tokens), preemption
# (24 blocks of 16 tokens hold the longest request, not all eight).
HARD = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=64,
            num_gpu_blocks_override=24)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama",
                                 max_position_embeddings=512)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(seed=2, shared_prefix_len=48)


@pytest.fixture(scope="module")
def plain(model_dir, prompts):
    """The engine without speculation (HARD settings), and its greedy outputs by prompt."""
    llm = LLM(model_dir, **HARD)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40,
                                                   ignore_eos=True, logprobs=2),
                           use_tqdm=False)
    return llm, {tuple(p): o.outputs[0] for p, o in zip(prompts, outputs, strict=True)}


def use_oracle(llm: LLM, reference: dict, corrupt_every: int = 3) -> None:
    """Replace the engine's proposer: the plain run's next K tokens (one of them wrong in
    every `corrupt_every`-th draft)."""
    def propose(request, max_drafts):
        tokens = reference[tuple(request.prompt_token_ids)].token_ids
        done = request.num_output_tokens
        draft = list(tokens[done:done + min(K, max_drafts)])
        if draft and done % corrupt_every == 1:
            draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 400
        return draft

    llm.engine_core.scheduler.speculator.propose = propose


def test_greedy_with_drafts_equals_plain_under_prefix_hits_chunking_preemption(
        model_dir, prompts, plain):
    _, reference = plain
    llm = LLM(model_dir, speculative_config=SPEC, **HARD)
    use_oracle(llm, reference)
    counts, preemptions = SpecCounts(llm), count_preemptions(llm)
    for _ in range(2):  # the second round hits the prefix cache of the first
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert output.outputs[0].token_ids == reference[tuple(prompt)].token_ids[:32]
    assert outputs[-1].num_cached_tokens > 0
    assert preemptions[0] > 0
    assert 0 < counts.accepted < counts.draft_tokens  # some drafts kept, some rolled back
    assert counts.rollbacks_freeing_blocks > 0
    assert_all_blocks_free(llm)


def test_ngram_proposer_equals_plain(model_dir, plain):
    """The real n-gram proposer, on prompts that repeat themselves (it proposes; the
    random model rarely agrees, so this is mostly a rollback test)."""
    plain_llm, _ = plain
    rng = np.random.default_rng(5)
    base = [rng.integers(3, 400, size=n).tolist() for n in (20, 45, 70)]
    repeating = [b + b[:n] for b, n in zip(base, (20, 30, 10), strict=True)]
    want = [o.outputs[0].token_ids for o in plain_llm.generate(repeating, GREEDY,
                                                                use_tqdm=False)]
    llm = LLM(model_dir, speculative_config=SPEC, **HARD)
    counts = SpecCounts(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(repeating, GREEDY, use_tqdm=False)]
    assert got == want
    assert counts.draft_tokens > 0
    assert_all_blocks_free(llm)


def test_stops_logprobs_and_n(model_dir, prompts, plain):
    """Several tokens a step must still stop where one-at-a-time decoding stops: stop
    strings (text and tokens cut at the match), stop token ids, max_tokens; logprobs and
    n > 1 match too."""
    plain_llm, reference = plain
    llm = LLM(model_dir, speculative_config=SPEC, **HARD)
    use_oracle(llm, reference, corrupt_every=5)
    counts = SpecCounts(llm)
    some = prompts[:4]
    texts = [reference[tuple(p)].text for p in some]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                       stop=[texts[0][10:14], texts[1][25:28]], logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                       stop_token_ids=[reference[tuple(some[2])].token_ids[9]]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, n=2, logprobs=1),
    ]
    for params in cases:
        want = plain_llm.generate(some, params, use_tqdm=False)
        got = llm.generate(some, params, use_tqdm=False)
        for w, g in zip(want, got, strict=True):
            for ws, gs in zip(w.outputs, g.outputs, strict=True):
                assert (gs.token_ids, gs.text, gs.finish_reason, gs.stop_reason) == (
                    ws.token_ids, ws.text, ws.finish_reason, ws.stop_reason)
                if params.logprobs is not None:
                    assert [lp.token_id for lp in gs.logprobs] == gs.token_ids
                    np.testing.assert_allclose([lp.logprob for lp in gs.logprobs],
                                               [lp.logprob for lp in ws.logprobs], atol=1e-4)
    assert counts.accepted > 0
    assert_all_blocks_free(llm)


def test_penalties_and_min_tokens_with_drafts_equal_plain(model_dir, prompts, plain):
    """Rules over a request's history (repetition, frequency and presence penalties,
    min_tokens) count each verified row's preceding drafts as outputs: greedy tokens with
    drafts equal the plain run's, under HARD's chunking, prefix hits and preemption."""
    plain_llm, reference = plain
    some = prompts[:5]
    # Each prompt's plain output would stop at its 4th token; min_tokens keeps it going.
    stops = sorted({reference[tuple(p)].token_ids[3] for p in some})
    cases = [
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
                       repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3),
        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, min_tokens=12,
                       stop_token_ids=stops, frequency_penalty=0.2),
    ]
    for params in cases:
        want = plain_llm.generate(some, params, use_tqdm=False)
        llm = LLM(model_dir, speculative_config=SPEC, **HARD)
        use_oracle(llm, {tuple(p): o.outputs[0] for p, o in zip(some, want, strict=True)})
        counts = SpecCounts(llm)
        got = llm.generate(some, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert 0 < counts.accepted < counts.draft_tokens
        assert_all_blocks_free(llm)
        llm.shutdown()
    # The rules changed the outputs (else this test could not tell rows apart).
    assert want[0].outputs[0].token_ids != reference[tuple(some[0])].token_ids[:32]


def test_sampled_requests_verify_their_drafts(model_dir, prompts, plain):
    """temperature > 0 with drafts: seeded outputs repeat, lengths and logprobs line up.
    (That the distribution is kept is tests/unit/sample/test_rejection.py.)"""
    _, reference = plain
    # A seeded request's tokens depend on its seed and on the drafts it verified in
    # which steps; HARD's budget and preemptions would change those between two runs.
    llm = LLM(model_dir, speculative_config={**SPEC, "disable_by_batch_size": 6},
              dtype="float32", max_model_len=512)
    use_oracle(llm, reference)
    counts = SpecCounts(llm)
    params = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, ignore_eos=True,
                            n=2, seed=11, logprobs=1)
    first = llm.generate(prompts[:3], params, use_tqdm=False)  # 6 requests
    second = llm.generate(prompts[:3], params, use_tqdm=False)
    for a, b in zip(first, second, strict=True):
        for sa, sb in zip(a.outputs, b.outputs, strict=True):
            assert sa.token_ids == sb.token_ids and len(sa.token_ids) == 24
            assert [lp.token_id for lp in sa.logprobs] == sa.token_ids
    assert counts.draft_tokens > 0
    assert_all_blocks_free(llm)


def test_abort_mid_verification_frees_every_block(model_dir, prompts, plain):
    _, reference = plain
    llm = LLM(model_dir, speculative_config=SPEC, **HARD)
    use_oracle(llm, reference)
    core = llm.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    req_ids = []
    for i, prompt in enumerate(prompts[:3]):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
        req_ids.append(f"r{i}")
    with_drafts = 0
    schedule = core.scheduler.schedule

    def counted_schedule():
        nonlocal with_drafts
        output = schedule()
        with_drafts += bool(output.scheduled_spec_decode_tokens)
        return output

    core.scheduler.schedule = counted_schedule
    while with_drafts < 3:
        core.step()
    assert core.abort_requests(req_ids) == req_ids
    core.step()  # the runner forgets them
    assert_all_blocks_free(llm)
    assert core.executor.runner.requests == {}


def test_async_scheduling_overlaps_steps_until_a_request_may_draft(model_dir, prompts, plain):
    """Async scheduling stays on: while more than disable_by_batch_size (2) requests run,
    steps are scheduled behind the one in flight; once few run, drafts need the last
    token, so a step that may carry drafts is scheduled with nothing in flight. Greedy
    tokens stay the plain run's, under preemption and chunked prefill, and no block leaks."""
    _, reference = plain
    llm = LLM(model_dir, speculative_config={**SPEC, "disable_by_batch_size": 2},
              async_scheduling=True, **HARD)
    core = llm.engine_core
    assert core._worker is not None
    use_oracle(llm, reference)
    counts, preemptions = SpecCounts(llm), count_preemptions(llm)
    scheduled = note_steps_in_flight(llm)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == reference[tuple(prompt)].token_ids[:32]
    assert any(in_flight for in_flight, _ in scheduled)  # overlapped while many ran
    assert not any(in_flight and drafts for in_flight, drafts in scheduled)
    assert 0 < counts.accepted < counts.draft_tokens
    assert preemptions[0] > 0
    assert not core._in_flight
    assert_all_blocks_free(llm)


# ------------------------------------------------------------------ the default model
COPY_TEXT = ("The paged KV cache stores the keys and values of every request in fixed-size "
             "blocks. A block table maps each request's token positions to the blocks that "
             "hold them, so memory is allocated one block at a time and shared prefixes can "
             "be reused.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.mark.slow
def test_default_model_copying_accepts_drafts_and_equals_plain():
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="256M",
              speculative_config=SPEC)
    conversations = [
        f"Repeat this text exactly, word for word:\n\n{COPY_TEXT}",
        f"Rename the function add to plus in this code and show all of it:\n\n{CODE}",
        "What is the capital of France?",
    ]
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}])
               for c in conversations]
    params = SamplingParams(temperature=0.0, max_tokens=64)
    counts = SpecCounts(llm)
    with_drafts = llm.generate(prompts, params, use_tqdm=False)
    assert counts.accepted > 0
    # The same engine with its speculator detached decodes one token a step.
    scheduler = llm.engine_core.scheduler
    speculator, scheduler.speculator = scheduler.speculator, None
    plain_outputs = llm.generate(prompts, params, use_tqdm=False)
    scheduler.speculator = speculator
    for got, want in zip(with_drafts, plain_outputs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert "fixed-size blocks" in with_drafts[0].outputs[0].text
    assert_all_blocks_free(llm)


def test_tensor_parallel_ranks_agree_on_verified_drafts(model_dir, prompts, plain):
    """TP=2: drafts travel in the step message; every rank keeps rank 0's verification
    (greedy, and sampled: the random draws of rank 0 decide)."""
    _, reference = plain
    some = prompts[:3]
    with LLM(model_dir, speculative_config=SPEC, tensor_parallel_size=2, **HARD) as llm:
        use_oracle(llm, reference)
        counts = SpecCounts(llm)
        got = llm.generate(some, GREEDY, use_tqdm=False)
        sampled = llm.generate(some, SamplingParams(temperature=0.8, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 16 for o in sampled)
        assert_all_blocks_free(llm)
    assert [o.outputs[0].token_ids for o in got] == [
        reference[tuple(p)].token_ids[:32] for p in some]
    assert counts.accepted > 0


def test_drafts_over_sliding_window_groups_equal_plain(tmp_path, prompts):
    """Gemma 3 (5 local layers with a 20-token window : 1 global, several KV-cache groups):
    a rollback trims every group's blocks, and the tokens stay the plain run's."""
    model = build_tiny_checkpoint(tmp_path / "gemma3", "gemma3", max_position_embeddings=512)
    chosen = prompts[:4]
    # Six groups of one layer (five windows): each window group holds at most
    # cdiv(19 + 64, 16) + 1 = 7 blocks per request, so 24 blocks would not do.
    settings = {**HARD, "num_gpu_blocks_override": 120}
    plain_llm = LLM(model, **settings)
    plain_outputs = plain_llm.generate(
        chosen, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    reference = {tuple(p): o.outputs[0] for p, o in zip(chosen, plain_outputs, strict=True)}
    llm = LLM(model, speculative_config=SPEC, **settings)
    assert llm.engine_core.scheduler.kv_cache_manager.num_groups > 1
    use_oracle(llm, reference)
    counts = SpecCounts(llm)
    manager, scheduler = llm.engine_core.scheduler.kv_cache_manager, llm.engine_core.scheduler
    schedule, lengths_checked = scheduler.schedule, []

    def schedule_checking_groups():
        # Every group's block list of a request is as long as group 0's (the contract the
        # runner's tables rely on), after rollbacks too.
        for req_id in manager.req_to_blocks:
            lengths = {len(group.req_to_blocks[req_id]) for group in manager.groups}
            assert len(lengths) == 1, (req_id, lengths)
            lengths_checked.append(req_id)
        return schedule()

    scheduler.schedule = schedule_checking_groups
    outputs = llm.generate(chosen, GREEDY, use_tqdm=False)
    for prompt, output in zip(chosen, outputs, strict=True):
        assert output.outputs[0].token_ids == reference[tuple(prompt)].token_ids[:32]
    assert lengths_checked
    assert 0 < counts.accepted < counts.draft_tokens
    assert counts.rollbacks_freeing_blocks > 0
    assert_all_blocks_free(llm)
