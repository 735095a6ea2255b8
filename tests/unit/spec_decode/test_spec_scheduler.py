"""The scheduler with speculative decoding, driven by a fake runner that verifies drafts
against a deterministic "model" (next token = a function of the last token)."""

from __future__ import annotations

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.outputs import ModelRunnerOutput
from engine.request import EngineCoreRequest, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched import Scheduler, SchedulerOutput
from tests.support.scheduler import BLOCK_SIZE, EOS, assert_all_blocks_free

CYCLE = [11, 12, 13, 14, 15, 16, 17]  # the model's text repeats this cycle


def cycle_model(tokens: list[int]) -> int:
    """The next token: the cycle's successor of the last token (21 after anything else)."""
    last = tokens[-1]
    return CYCLE[(CYCLE.index(last) + 1) % len(CYCLE)] if last in CYCLE else 21


def make_spec_scheduler(num_blocks: int = 100, *, max_num_batched_tokens: int = 64,
                        k: int = 4, **spec) -> Scheduler:
    spec.setdefault("prompt_lookup_min", 2)
    return Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=256),
        CacheConfig(block_size=BLOCK_SIZE), num_blocks,
        speculative_config=SpeculativeConfig(num_speculative_tokens=k, **spec))


def add(scheduler: Scheduler, req_id: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 40)
    return scheduler.add_request(
        EngineCoreRequest(req_id, prompt, SamplingParams(**params), eos_token_id=EOS))


def verify(scheduler: Scheduler, out: SchedulerOutput, model=cycle_model) -> ModelRunnerOutput:
    """What the runner returns: the accepted drafts and one more token per sampling request."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
        known = request.num_computed_tokens - len(drafts)
        if known < request.num_tokens:
            sampled.append([])  # mid-prefill
            continue
        tokens, seq = [], list(request.all_token_ids)
        for draft in drafts:
            token = model(seq)
            tokens.append(token)
            if token != draft:
                break
            seq.append(token)
        else:
            tokens.append(model(seq))
        sampled.append(tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def step(scheduler: Scheduler, model=cycle_model):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, verify(scheduler, out, model))


def test_copying_request_gets_drafts_and_keeps_them():
    scheduler = make_spec_scheduler()
    request = add(scheduler, "a", CYCLE * 2)
    out, _ = step(scheduler)  # prefill
    assert out.scheduled_spec_decode_tokens == {}
    out, engine_out = step(scheduler)
    stats = engine_out.scheduler_stats
    # The text ends [.. 16, 17, 11] (11 sampled after the prefill); [17, 11] occurred
    # before: the draft continues the cycle, and the model agrees.
    assert out.scheduled_spec_decode_tokens == {"a": [12, 13, 14, 15]}
    assert out.num_scheduled_tokens == {"a": 5}
    assert engine_out.outputs[0].new_token_ids == [12, 13, 14, 15, 16]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens) == (1, 4, 4)
    assert stats.spec_num_accepted_tokens_per_pos == [1, 1, 1, 1]


def test_rejected_drafts_are_rolled_back_and_their_blocks_freed():
    scheduler = make_spec_scheduler()
    # The prompt teaches [17, 11] -> 99 ...; the model says 11 -> 12: the draft fails.
    request = add(scheduler, "a", [17, 11, 99, 98, 97, 96, 5, 17])
    step(scheduler)  # prefill; samples 11
    out, engine_out = step(scheduler)
    assert out.scheduled_spec_decode_tokens == {"a": [99, 98, 97, 96]}
    # 1 + 4 slots from position 8: positions 8..12, blocks 0..3 of 4 tokens.
    assert out.num_scheduled_tokens == {"a": 5}
    assert engine_out.outputs[0].new_token_ids == [12]
    assert request.num_tokens == 10 and request.num_computed_tokens == 9
    # Block 3 (positions 12..15) held only rejected slots: freed; the runner hears of
    # the shorter block list with the next step.
    assert len(scheduler.kv_cache_manager.req_to_blocks["a"]) == 3
    out, _ = step(scheduler)
    assert out.num_blocks_after_rollback == {"a": 3}
    scheduler.finish_requests(["a"], request.status.FINISHED_ABORTED)
    assert_all_blocks_free(scheduler)


def test_drafts_fit_the_token_budget_and_max_tokens():
    scheduler = make_spec_scheduler(max_num_batched_tokens=3)
    add(scheduler, "a", CYCLE * 2, max_tokens=40)
    for _ in range(6):  # prefill in 3-token chunks
        step(scheduler)
    out, _ = step(scheduler)
    assert len(out.scheduled_spec_decode_tokens["a"]) == 2  # budget 3 = 1 + 2 drafts

    scheduler = make_spec_scheduler()
    request = add(scheduler, "b", CYCLE * 2, max_tokens=3)
    step(scheduler)  # prefill + 1 token
    out, engine_out = step(scheduler)
    assert out.scheduled_spec_decode_tokens == {"b": [12]}  # 2 tokens left: 1 draft + bonus
    assert request.is_finished and request.num_output_tokens == 3
    assert_all_blocks_free(scheduler)


def test_a_request_that_cannot_get_draft_blocks_decodes_normally():
    # 4 blocks of 4: the 14-token prompt fills 4 blocks; decoding position 14 fits in
    # them, positions 14..18 (1 + 4 drafts) would need a fifth.
    scheduler = make_spec_scheduler(num_blocks=4)
    request = add(scheduler, "a", CYCLE * 2)
    step(scheduler)
    out, _ = step(scheduler)
    assert out.preempted_req_ids == set()
    assert out.scheduled_spec_decode_tokens == {}
    assert out.num_scheduled_tokens == {"a": 1}
    assert request.num_output_tokens == 2


def test_no_drafts_in_a_wide_batch():
    scheduler = make_spec_scheduler(disable_by_batch_size=2)
    for i in range(3):
        add(scheduler, f"r{i}", CYCLE * 2)
    step(scheduler)
    out, _ = step(scheduler)
    assert out.scheduled_spec_decode_tokens == {}
    scheduler.finish_requests(["r0"], scheduler.requests["r0"].status.FINISHED_ABORTED)
    out, _ = step(scheduler)
    assert set(out.scheduled_spec_decode_tokens) == {"r1", "r2"}


def test_may_draft_says_when_a_step_may_carry_drafts():
    """What async scheduling asks before scheduling behind a step in flight."""
    scheduler = make_spec_scheduler(disable_by_batch_size=2)
    assert not scheduler.may_draft()  # nothing runs
    add(scheduler, "r0", CYCLE * 2)
    r1 = add(scheduler, "r1", CYCLE * 2)
    # r1 drafted 16 tokens and none was kept: the back-off pauses it for 64 tokens.
    scheduler.speculator.propose(r1, 4)
    scheduler.speculator.record("r1", 16, 0, len(r1.all_token_ids))
    assert not scheduler.speculator.may_propose(r1)
    step(scheduler)
    assert scheduler.may_draft()
    out, _ = step(scheduler)
    assert set(out.scheduled_spec_decode_tokens) == {"r0"}
    add(scheduler, "r2", CYCLE * 2)
    step(scheduler)  # r2's prefill: 3 running
    assert not scheduler.may_draft()
    out, _ = step(scheduler)
    assert out.scheduled_spec_decode_tokens == {}
    scheduler.finish_requests(["r0", "r2"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.may_draft()  # r1 alone: paused
    out, _ = step(scheduler)
    assert out.scheduled_spec_decode_tokens == {}


def test_preempting_a_speculating_request_frees_everything():
    scheduler = make_spec_scheduler(num_blocks=10)
    add(scheduler, "a", CYCLE * 2, max_tokens=60)
    add(scheduler, "b", CYCLE * 2 + [11], max_tokens=60)
    num_preempted = num_spec_steps = 0
    for _ in range(60):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler)
        num_preempted += len(out.preempted_req_ids)
        num_spec_steps += bool(out.scheduled_spec_decode_tokens)
        for request in scheduler.running:
            blocks = scheduler.kv_cache_manager.req_to_blocks[request.req_id]
            assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens
    assert num_preempted > 0 and num_spec_steps > 0
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_xray_shows_each_requests_acceptance():
    from engine.core.xray import XrayRecorder, build_snapshot
    from engine.xray_schema import XrayLimits

    scheduler = make_spec_scheduler()
    add(scheduler, "a", CYCLE * 2)
    add(scheduler, "b", [17, 11, 99, 98, 97, 96, 5, 17])
    step(scheduler)
    step(scheduler)
    snapshot = build_snapshot(scheduler, XrayRecorder(scheduler), 2, XrayLimits())
    rows = {r.req_id: r for r in snapshot.running}
    assert (rows["a"].num_draft_tokens, rows["a"].num_accepted_tokens) == (4, 4)
    assert (rows["b"].num_draft_tokens, rows["b"].num_accepted_tokens) == (4, 0)


def test_without_a_speculative_config_nothing_speculates():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                          max_model_len=256),
                          CacheConfig(block_size=BLOCK_SIZE), 100)
    assert scheduler.speculator is None
    add(scheduler, "a", CYCLE * 2)
    for _ in range(3):
        out, engine_out = step(scheduler)
        assert out.scheduled_spec_decode_tokens == {} and out.num_blocks_after_rollback == {}
        assert engine_out.scheduler_stats.spec_num_drafts == 0
    assert scheduler.requests["a"].num_output_tokens == 3
