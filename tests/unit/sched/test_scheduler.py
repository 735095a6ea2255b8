"""The scheduler, driven step by step with a fake model runner."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from engine.outputs import ModelRunnerOutput
from engine.request import Request, RequestStatus
from engine.sched import Scheduler, SchedulerOutput
from tests.support.scheduler import (
    BLOCK_SIZE,
    EOS,
    add,
    assert_all_blocks_free,
    fake_runner_output,
    make_scheduler,
    output_of,
    run_to_completion,
    running_ids,
    step,
    waiting_ids,
)


# ------------------------------------------------------------------ basics
def test_prefill_then_decode_output_diff():
    scheduler = make_scheduler()
    request = add(scheduler, "a", 6)

    out, engine_out = step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("a", [0, 1], 0)
    assert new.prompt_token_ids == request.prompt_token_ids
    assert out.scheduled_cached_reqs.num_reqs == 0
    assert out.num_scheduled_tokens == {"a": 6}
    assert out.total_num_scheduled_tokens == 6
    assert output_of(engine_out, "a").new_token_ids == [1006]
    assert request.num_computed_tokens == 6 and request.num_tokens == 7

    out, _ = step(scheduler)  # position 6: still block 1
    cached = out.scheduled_cached_reqs
    assert out.scheduled_new_reqs == []
    assert (cached.req_ids, cached.new_block_ids, cached.num_computed_tokens) == (
        ["a"], [[]], [6])
    assert cached.resumed_from_preemption == [False]
    assert out.num_scheduled_tokens == {"a": 1}

    step(scheduler)  # position 7 fills block 1
    out, _ = step(scheduler)  # position 8 starts block 2
    assert out.scheduled_cached_reqs.new_block_ids == [[2]]
    assert scheduler.kv_cache_manager.get_block_ids("a") == [0, 1, 2]
    assert request.output_token_ids == [1006, 1007, 1008, 1009]


def test_add_request_validation():
    scheduler = make_scheduler(max_model_len=16)
    add(scheduler, "a", 4)
    with pytest.raises(ValueError):
        add(scheduler, "a", 4)
    with pytest.raises(ValueError):
        add(scheduler, "long", 16)
    assert add(scheduler, "none", 10, max_tokens=None).max_tokens == 6
    assert add(scheduler, "clip", 10, max_tokens=50).max_tokens == 6
    assert add(scheduler, "ok", 10, max_tokens=3).max_tokens == 3


def test_empty_step():
    scheduler = make_scheduler()
    out, engine_out = step(scheduler)
    assert out.is_empty and out.num_scheduled_tokens == {}
    assert engine_out.outputs == []


# ------------------------------------------------------------------ budgets
def test_chunked_prefill_respects_token_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "a", 20)
    chunks, samples = [], []
    for _ in range(3):
        out, engine_out = step(scheduler)
        chunks.append(out.num_scheduled_tokens["a"])
        samples.append([o.new_token_ids for o in engine_out.outputs])
    assert chunks == [8, 8, 4]
    assert samples == [[], [], [[1020]]]  # nothing sampled mid-prefill


def test_decodes_and_prefill_chunks_share_a_step():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "a", 3)
    add(scheduler, "b", 3)
    step(scheduler)  # both prefilled: 6 tokens
    add(scheduler, "c", 20)
    out, _ = step(scheduler)
    # Running requests first (one decode token each), then c's chunk fills the rest.
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6}
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"]
    assert out.total_num_scheduled_tokens == 8


def test_token_and_seat_budgets_hold_every_step():
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3)
    for i in range(6):
        add(scheduler, f"r{i}", 10 + i, max_tokens=4)
    for _ in range(100):
        if not scheduler.has_unfinished_requests():
            break
        out, _ = step(scheduler)
        assert 0 < out.total_num_scheduled_tokens <= 16
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(out.num_scheduled_tokens) <= 3
        assert len(scheduler.running) <= 3
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_seat_budget_admits_when_a_seat_frees():
    scheduler = make_scheduler(max_num_seqs=2)
    add(scheduler, "a", 4, max_tokens=1)
    add(scheduler, "b", 4, max_tokens=3)
    add(scheduler, "c", 4)
    out, engine_out = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert output_of(engine_out, "a").finish_reason == "length"
    assert waiting_ids(scheduler) == ["c"]
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"b": 1, "c": 4}
    assert out.finished_req_ids == {"a"}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False,
                               max_model_len=8)
    add(scheduler, "a", 6)
    add(scheduler, "b", 6)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 6}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}


def test_without_chunked_prefill_the_budget_must_hold_a_whole_context():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False, max_model_len=16)


def test_a_request_never_outgrows_the_whole_cache():
    scheduler = make_scheduler(num_blocks=2, max_model_len=64)  # 2 blocks of BLOCK_SIZE
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        add(scheduler, "big", 3 * BLOCK_SIZE)
    assert not scheduler.has_unfinished_requests()
    request = add(scheduler, "fits", BLOCK_SIZE, max_tokens=100)
    assert request.max_tokens == BLOCK_SIZE  # capped: it finishes with "length" at 2 blocks


def test_a_failed_step_discards_the_blocks_it_hashed():
    scheduler = make_scheduler()
    prompt = list(range(1000, 1000 + 3 * BLOCK_SIZE))
    add(scheduler, "a", prompt)
    scheduler.schedule()  # blocks of "a" are hashed at allocation, before any KV is written
    assert scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ERROR)
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    add(scheduler, "b", prompt)
    _, num_hit = scheduler.kv_cache_manager.get_computed_blocks(scheduler.requests["b"])
    assert num_hit == 0


# ------------------------------------------------------------------ preemption
def fill_three_requests(scheduler: Scheduler) -> tuple[Request, Request, Request]:
    """a, b (1 block each) and c (2 blocks) in a pool of 5, just before a needs a block."""
    a = add(scheduler, "a", 3)
    b = add(scheduler, "b", 3)
    c = add(scheduler, "c", 7)
    step(scheduler)  # prefill: 4, 4 and 8 tokens; 1 block free
    step(scheduler)  # decode: a, b fill block 0, c fills block 1; 5, 5, 9 tokens
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    return a, b, c


def test_fcfs_preempts_the_last_running_request():
    scheduler = make_scheduler(num_blocks=5)
    a, b, c = fill_three_requests(scheduler)
    add(scheduler, "d", 2)  # would fit after c is preempted
    c_outputs = list(c.output_token_ids)

    out, engine_out = step(scheduler)
    # a takes the free block; b preempts c (the last) and takes one of its blocks.
    assert out.preempted_req_ids == {"c"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [[4], [3]]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == c_outputs  # kept for the recompute
    assert "c" not in scheduler.kv_cache_manager.req_to_blocks
    # c goes to the FRONT of waiting; d is not admitted in a step that preempted,
    # although a block and budget are free.
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 1
    assert waiting_ids(scheduler) == ["c", "d"]
    assert running_ids(scheduler) == ["a", "b"]
    assert engine_out.scheduler_stats.num_preemptions == 1


def test_preempted_request_resumes_with_its_whole_block_list():
    scheduler = make_scheduler(num_blocks=5)
    a, b, c = fill_three_requests(scheduler)
    step(scheduler)  # c preempted
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(scheduler)
    cached = out.scheduled_cached_reqs
    assert out.scheduled_new_reqs == []
    assert cached.req_ids == ["c"] and cached.resumed_from_preemption == [True]
    assert cached.new_block_ids == [scheduler.kv_cache_manager.get_block_ids("c")]
    # c recomputes its 9 tokens (7 prompt + 2 sampled), reusing its cached first block.
    assert cached.num_computed_tokens == [4]
    assert out.num_scheduled_tokens == {"c": 5}
    assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 9
    assert c.num_output_tokens == 3  # sampled again at the end of the recompute


def test_request_preempts_itself_when_it_is_last():
    scheduler = make_scheduler(num_blocks=3)
    add(scheduler, "a", 2, max_tokens=3)
    b = add(scheduler, "b", 7, max_tokens=3)
    step(scheduler)  # a: 3 tokens (block 0); b: 8 tokens (blocks 1, 2); none free
    step(scheduler)  # a: 4 tokens; b: 9 tokens
    out, _ = step(scheduler)
    # a computes position 3 in place; b needs a third block, none is free, and b
    # is the last running request: it is its own victim.
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and waiting_ids(scheduler) == ["b"]
    # a finished (max_tokens=3) in that step: b resumes, its two blocks still cached.
    out, engine_out = step(scheduler)
    assert out.scheduled_cached_reqs.resumed_from_preemption == [True]
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert out.num_scheduled_tokens == {"b": 1}
    assert output_of(engine_out, "b").finish_reason == "length"
    assert b.num_output_tokens == 3
    assert_all_blocks_free(scheduler)


def test_fcfs_multiple_preemptions_keep_running_order_in_waiting():
    scheduler = make_scheduler(num_blocks=4)
    for name in "abcd":
        add(scheduler, name, 3)
    step(scheduler)
    step(scheduler)  # each at 5 tokens, 1 block each, none free
    add(scheduler, "e", 1)
    out, _ = step(scheduler)  # every request needs a second block
    # a preempts d, b preempts c; c and d go back in their running order, before e.
    assert out.preempted_req_ids == {"c", "d"}
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert running_ids(scheduler) == ["a", "b"]
    assert waiting_ids(scheduler) == ["c", "d", "e"]


def test_priority_preempts_highest_priority_value_not_the_last():
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    add(scheduler, "a", 3, priority=0)
    add(scheduler, "b", 3, priority=5)
    step(scheduler)  # a, b: 4 tokens, 1 block each
    add(scheduler, "c", 3, priority=1)
    add(scheduler, "d", 3, priority=1)
    step(scheduler)  # a, b: 5 tokens; c, d admitted: 4 tokens, 1 block each
    assert running_ids(scheduler) == ["a", "b", "c", "d"]
    out, _ = step(scheduler)
    # a needs a second block first: the victim is b (priority 5), not d (the last).
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1, "c": 1, "d": 1}
    assert scheduler.requests["b"].status == RequestStatus.PREEMPTED
    assert running_ids(scheduler) == ["a", "c", "d"]
    assert waiting_ids(scheduler) == ["b"]


def test_priority_tie_preempts_the_latest_arrival():
    scheduler = make_scheduler(num_blocks=3, policy="priority")
    add(scheduler, "late", 3, priority=1, arrival_time=20.0)
    add(scheduler, "early", 3, priority=1, arrival_time=10.0)
    add(scheduler, "first", 2, priority=0, arrival_time=30.0)
    step(scheduler)
    assert running_ids(scheduler) == ["first", "early", "late"]  # by priority, arrival
    step(scheduler)  # early, late: 5 tokens; first: 4 tokens; no block free
    out, _ = step(scheduler)
    # first fits in place; early needs a block: among equal priorities the latest
    # arrival (late) is preempted, although early itself is a candidate too.
    assert out.preempted_req_ids == {"late"}
    assert out.num_scheduled_tokens == {"first": 1, "early": 1}
    assert running_ids(scheduler) == ["first", "early"]


def test_priority_victim_scheduled_earlier_in_the_step_is_unscheduled():
    scheduler = make_scheduler(num_blocks=2, policy="priority")
    low = add(scheduler, "low", 2, priority=9)
    step(scheduler)  # low: 3 tokens in block 0
    add(scheduler, "high", 4, priority=0)
    step(scheduler)  # low: 4 tokens; high: 5 tokens in block 1; none free
    assert running_ids(scheduler) == ["low", "high"]
    pool = scheduler.kv_cache_manager.block_pool
    out = scheduler.schedule()
    # low is scheduled first (position 3 fits in block 0); then high needs a block
    # and the victim is low, already scheduled: its token goes back to the budget.
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.total_num_scheduled_tokens == 1
    assert out.scheduled_cached_reqs.req_ids == ["high"]
    assert out.scheduled_cached_reqs.new_block_ids == [[0]]
    assert low.num_computed_tokens == 0 and low.status == RequestStatus.PREEMPTED
    # Block 0 was hashed for low's uncomputed position 3; high's allocation evicted it,
    # so no later request can hit KV that was never written.
    assert pool.get_cached_block(low.block_hashes[0]) is None


def test_priority_victim_skipped_earlier_in_the_step_does_not_skip_the_next_request():
    """A victim that stood before the request needing room but was not scheduled this
    step (async scheduling: its unknown last token may be its last) leaves the queue
    all the same: the requests after it move up one, and each still gets its turn."""
    scheduler = make_scheduler(num_blocks=5, policy="priority")
    low = add(scheduler, "V", 3, priority=5, max_tokens=3)
    step(scheduler)
    for name, prompt in (("A", 4), ("B", 4), ("C", 2)):
        add(scheduler, name, prompt)
    step(scheduler)  # V, A, B, C running; one block free
    assert running_ids(scheduler) == ["V", "A", "B", "C"]
    low.num_output_placeholders = 1  # its 3rd token is in flight: it may not run ahead
    out = scheduler.schedule()
    # A takes the free block, B needs one: the victim is V (before B, skipped this
    # step). C's decode fits in its own block, so C runs too.
    assert out.preempted_req_ids == {"V"}
    assert out.num_scheduled_tokens == {"A": 1, "B": 1, "C": 1}


def test_waiting_requests_never_preempt_running_ones():
    scheduler = make_scheduler(num_blocks=3)
    add(scheduler, "a", 8)
    step(scheduler)  # a: 9 tokens in 3 blocks
    add(scheduler, "b", 3)
    out, _ = step(scheduler)
    assert out.preempted_req_ids == set()
    assert out.num_scheduled_tokens == {"a": 1}
    assert waiting_ids(scheduler) == ["b"]


def test_priority_waiting_request_preempts_the_lowest_priority_running_one_for_blocks():
    scheduler = make_scheduler(num_blocks=4, policy="priority")
    add(scheduler, "low", 3, priority=5)
    add(scheduler, "lowest", 3, priority=9)
    add(scheduler, "mid", 3, priority=1)
    step(scheduler)  # 1 block each, 1 free; 4 tokens each after sampling
    lowest = scheduler.requests["lowest"]
    add(scheduler, "high", 7, priority=0)  # needs 2 blocks
    out = scheduler.schedule()
    # The three decodes fit their blocks; high needs 2 blocks with 1 free: lowest
    # (already scheduled this step) is unscheduled and preempted, freeing its block.
    assert out.preempted_req_ids == {"lowest"}
    assert out.num_scheduled_tokens == {"low": 1, "mid": 1, "high": 7}
    assert out.total_num_scheduled_tokens == 9
    assert running_ids(scheduler) == ["mid", "low", "high"]  # admitted by priority
    assert waiting_ids(scheduler) == ["lowest"]
    assert lowest.status == RequestStatus.PREEMPTED and lowest.num_computed_tokens == 0
    manager = scheduler.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == 0
    assert [len(manager.get_block_ids(r)) for r in ("low", "mid", "high")] == [1, 1, 2]
    assert manager.get_block_ids("lowest") == []


def test_priority_waiting_request_preempts_for_a_seat():
    scheduler = make_scheduler(max_num_seqs=2, policy="priority")
    add(scheduler, "low", 3, priority=9)
    add(scheduler, "mid", 3, priority=5)
    step(scheduler)
    add(scheduler, "high", 3, priority=0)
    out = scheduler.schedule()
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"mid": 1, "high": 3}
    assert running_ids(scheduler) == ["mid", "high"]
    assert waiting_ids(scheduler) == ["low"]


def test_priority_waiting_request_never_preempts_an_equal_priority():
    scheduler = make_scheduler(num_blocks=2, max_num_seqs=1, policy="priority")
    add(scheduler, "first", 3, priority=1, arrival_time=1.0)
    step(scheduler)
    add(scheduler, "second", 3, priority=1, arrival_time=0.5)
    out, _ = step(scheduler)
    assert out.preempted_req_ids == set()
    assert out.num_scheduled_tokens == {"first": 1}
    assert waiting_ids(scheduler) == ["second"]


def test_preempted_victims_unwritten_blocks_are_no_prefix_hits():
    """A victim unscheduled in the step that hashed its blocks never wrote their KV."""
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=16, policy="priority")
    low = add(scheduler, "low", 24, priority=9)
    step(scheduler)  # low: positions 0-15 written (blocks 0-3)
    add(scheduler, "high", 7, priority=0)
    out, _ = step(scheduler)
    # low was given positions 16-23 (blocks 4 and 5, hashed as full); then high needs
    # 2 blocks with 1 free: low is preempted before its chunk ran.
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 7}
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_cached_block(low.block_hashes[4]) is None
    assert pool.get_cached_block(low.block_hashes[5]) is None
    # Its written prefix still serves it when it resumes: 16 tokens, not 20 or 24.
    assert scheduler.kv_cache_manager.get_computed_blocks(low)[1] == 16
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_priority_waiting_queue_order():
    scheduler = make_scheduler(policy="priority", max_num_seqs=1)
    add(scheduler, "p5", 3, priority=5, arrival_time=1.0)
    add(scheduler, "p1-late", 3, priority=1, arrival_time=3.0)
    add(scheduler, "p1-early", 3, priority=1, arrival_time=2.0)
    assert waiting_ids(scheduler) == ["p1-early", "p1-late", "p5"]
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["p1-early"]


# ------------------------------------------------------------------ abort
def test_abort_frees_every_block_wherever_the_request_is():
    scheduler = make_scheduler(num_blocks=5)
    fill_three_requests(scheduler)
    add(scheduler, "d", 2)
    step(scheduler)  # c preempted; d waiting
    assert running_ids(scheduler) == ["a", "b"] and waiting_ids(scheduler) == ["c", "d"]
    requests = {r: scheduler.requests[r] for r in "abcd"}

    finished = scheduler.finish_requests(["a", "c", "d", "b", "unknown"],
                                         RequestStatus.FINISHED_ABORTED)
    assert finished == ["a", "c", "d", "b"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in requests.values())
    assert scheduler.requests == {}
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a", "b", "c", "d"}
    assert scheduler.schedule().finished_req_ids == set()  # reported once
    assert scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == []


def test_abort_while_the_step_runs():
    scheduler = make_scheduler()
    add(scheduler, "a", 5)
    add(scheduler, "b", 5)
    out = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, out)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    engine_out = scheduler.update_from_output(out, runner_output)
    assert [o.req_id for o in engine_out.outputs] == ["b"]
    assert "a" not in scheduler.kv_cache_manager.req_to_blocks
    run_to_completion(scheduler)
    assert_all_blocks_free(scheduler)


def test_runner_error_finishes_the_request_and_frees_its_blocks():
    scheduler = make_scheduler()
    add(scheduler, "a", 5)
    out = scheduler.schedule()
    runner_output = fake_runner_output(scheduler, out)
    runner_output.errors["a"] = "boom"
    engine_out = scheduler.update_from_output(out, runner_output)
    (output,) = engine_out.outputs
    assert (output.finish_reason, output.error) == ("error", "boom")
    assert_all_blocks_free(scheduler)


# ------------------------------------------------------------------ prefix cache
def test_fully_cached_prompt_still_computes_its_last_token():
    scheduler = make_scheduler()
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    add(scheduler, "a", prompt, max_tokens=1)
    run_to_completion(scheduler)
    b = add(scheduler, "b", prompt, max_tokens=1)
    out, engine_out = step(scheduler)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == len(prompt) - 1 == 8
    assert out.num_scheduled_tokens == {"b": 1}
    assert new.block_ids[:2] == [0, 1]  # a's cached blocks
    assert output_of(engine_out, "b").num_cached_tokens == 8
    assert b.num_cached_tokens == 8
    stats = engine_out.scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9, 8)


def test_prefix_cache_stats_are_in_tokens():
    scheduler = make_scheduler()
    shared = list(range(100, 112))  # 3 blocks
    add(scheduler, "a", shared + [1, 2])
    _, engine_out = step(scheduler)
    assert (engine_out.scheduler_stats.prefix_cache_queries,
            engine_out.scheduler_stats.prefix_cache_hits) == (14, 0)
    add(scheduler, "b", shared + [3, 4, 5])
    add(scheduler, "c", shared[:5] + [6])
    _, engine_out = step(scheduler)
    stats = engine_out.scheduler_stats
    assert stats.prefix_cache_queries == 15 + 6
    assert stats.prefix_cache_hits == 12 + 4
    _, engine_out = step(scheduler)
    assert engine_out.scheduler_stats.prefix_cache_queries == 0  # reset per step


def test_cache_salt_separates_tenants_in_the_scheduler():
    scheduler = make_scheduler()
    prompt = list(range(100, 109))
    add(scheduler, "a", prompt, cache_salt="tenant-a", max_tokens=1)
    run_to_completion(scheduler)
    add(scheduler, "b", prompt, cache_salt="tenant-b", max_tokens=1)
    add(scheduler, "c", prompt, cache_salt="tenant-a", max_tokens=1)
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"b": 9, "c": 1}


def test_no_prefix_caching():
    scheduler = make_scheduler(enable_prefix_caching=False)
    prompt = list(range(100, 109))
    add(scheduler, "a", prompt, max_tokens=1)
    run_to_completion(scheduler)
    add(scheduler, "b", prompt, max_tokens=1)
    out, engine_out = step(scheduler)
    assert out.num_scheduled_tokens == {"b": 9}
    assert engine_out.scheduler_stats.prefix_cache_queries == 0


# ------------------------------------------------------------------ stop conditions
def emit(tokens: list[int]) -> Callable[[Request], int]:
    """A sampler that emits `tokens` in order (by output position)."""
    return lambda request: tokens[request.num_output_tokens]


def finish(scheduler: Scheduler, req_id: str, tokens: list[int]):
    """Run until `req_id` finishes; return its final output and its request."""
    request = scheduler.requests[req_id]
    for output in run_to_completion(scheduler, sample=emit(tokens)):
        if output.finished:
            assert output.req_id == req_id
            return output, request
    raise AssertionError("no finished output")


def test_eos_stops():
    scheduler = make_scheduler()
    add(scheduler, "a", 5)
    output, request = finish(scheduler, "a", [7, 8, EOS, 9])
    assert request.output_token_ids == [7, 8, EOS]
    assert output.new_token_ids == [EOS]
    assert (output.finish_reason, output.stop_reason) == ("stop", None)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert_all_blocks_free(scheduler)
    assert scheduler.schedule().finished_req_ids == {"a"}


def test_ignore_eos_runs_to_max_tokens():
    scheduler = make_scheduler()
    add(scheduler, "a", 5, ignore_eos=True, max_tokens=4)
    output, request = finish(scheduler, "a", [EOS] * 4)
    assert request.output_token_ids == [EOS] * 4
    assert output.finish_reason == "length"
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_stop_token_ids_set_stop_reason():
    scheduler = make_scheduler()
    add(scheduler, "a", 5, stop_token_ids=[42, 43])
    output, request = finish(scheduler, "a", [7, 43, 9])
    assert request.output_token_ids == [7, 43]
    assert (output.finish_reason, output.stop_reason) == ("stop", 43)


def test_max_tokens_gives_length():
    scheduler = make_scheduler()
    add(scheduler, "a", 5, max_tokens=3)
    output, request = finish(scheduler, "a", [7, 8, 9, 10])
    assert request.output_token_ids == [7, 8, 9]
    assert (output.finish_reason, output.stop_reason) == ("length", None)


@pytest.mark.parametrize("stop", [EOS, 42])
def test_min_tokens_suppresses_eos_and_stop_tokens(stop):
    scheduler = make_scheduler()
    add(scheduler, "a", 5, min_tokens=3, stop_token_ids=[42])
    output, request = finish(scheduler, "a", [stop] * 5)
    assert request.output_token_ids == [stop] * 3
    assert output.finish_reason == "stop"


def test_max_model_len_gives_length():
    scheduler = make_scheduler(max_model_len=16)
    add(scheduler, "a", 10, max_tokens=None)
    output, request = finish(scheduler, "a", list(range(100, 120)))
    assert request.num_tokens == 16 and request.num_output_tokens == 6
    assert output.finish_reason == "length"


def test_min_tokens_beyond_max_model_len_still_ends():
    """Regression: min_tokens used to suppress the length checks too, so this request
    stayed in `running` forever with nothing left to schedule."""
    scheduler = make_scheduler(max_model_len=16)
    add(scheduler, "a", 10, max_tokens=None, min_tokens=8)
    output, request = finish(scheduler, "a", [EOS] * 10)
    assert request.num_tokens == 16
    assert output.finish_reason == "length"
    assert_all_blocks_free(scheduler)


def test_eos_on_the_last_allowed_token_reports_stop():
    scheduler = make_scheduler()
    add(scheduler, "a", 5, max_tokens=2)
    output, request = finish(scheduler, "a", [7, EOS])
    assert output.finish_reason == "stop"


def test_generation_and_prompt_token_stats():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "a", 12)
    _, engine_out = step(scheduler)
    stats = engine_out.scheduler_stats
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (8, 0)
    assert stats.num_scheduled_tokens == 8
    _, engine_out = step(scheduler)
    stats = engine_out.scheduler_stats
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (4, 1)
    _, engine_out = step(scheduler)
    stats = engine_out.scheduler_stats
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (0, 1)
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 0)
    assert stats.kv_cache_usage == pytest.approx(4 / 100)


# ------------------------------------------------------------------ async scheduling
def make_async_scheduler(**kwargs) -> Scheduler:
    scheduler = make_scheduler(**kwargs)
    scheduler.config = dataclasses.replace(scheduler.config, async_scheduling=True)
    return scheduler


def schedule_ahead(scheduler: Scheduler) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """schedule() plus the output a runner would give once the step runs: a token for
    each request that got a placeholder in this step (token = 1000 + its position)."""
    before = {r.req_id: r.num_output_placeholders for r in scheduler.requests.values()}
    out = scheduler.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        samples = request.num_output_placeholders > before.get(req_id, 0)
        sampled.append([1000 + request.num_computed_tokens] if samples else [])
    return out, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)


def test_async_schedules_the_next_position_before_the_token_is_known():
    scheduler = make_async_scheduler()
    a = add(scheduler, "a", 5)
    b = add(scheduler, "b", 3)
    first = schedule_ahead(scheduler)  # prefill: both sample; one placeholder each
    assert first[0].num_scheduled_tokens == {"a": 5, "b": 3}
    assert (a.num_output_placeholders, b.num_output_placeholders) == (1, 1)
    second = schedule_ahead(scheduler)  # before the first step's tokens are known
    assert second[0].num_scheduled_tokens == {"a": 1, "b": 1}
    assert (a.num_computed_tokens, a.num_tokens, a.num_output_placeholders) == (6, 5, 2)
    out = scheduler.update_from_output(*first)
    assert {o.req_id: o.new_token_ids for o in out.outputs} == {"a": [1005], "b": [1003]}
    assert (a.num_tokens, a.num_output_placeholders) == (6, 1)
    out = scheduler.update_from_output(*second)
    assert {o.req_id: o.new_token_ids for o in out.outputs} == {"a": [1006], "b": [1004]}
    assert all(r.num_output_placeholders == 0 and r.num_computed_tokens == r.num_tokens - 1
               for r in (a, b))


def test_async_never_runs_past_max_tokens_and_drops_tokens_after_a_stop():
    scheduler = make_async_scheduler()
    add(scheduler, "one", 3, max_tokens=1)
    add(scheduler, "eos", 3)
    first = schedule_ahead(scheduler)
    second = schedule_ahead(scheduler)
    # "one" samples its only token in the first step: nothing to compute ahead.
    assert second[0].num_scheduled_tokens == {"eos": 1}
    first[1].sampled_token_ids[first[1].req_id_to_index["eos"]] = [EOS]
    out = scheduler.update_from_output(*first)
    assert {o.req_id: (o.new_token_ids, o.finish_reason) for o in out.outputs} == {
        "one": ([1003], "length"), "eos": ([EOS], "stop")}
    # The second step computed a token for "eos" after its stop: never reported.
    out = scheduler.update_from_output(*second)
    assert out.outputs == []
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)


def test_async_request_preempted_while_its_step_runs_keeps_that_token():
    scheduler = make_async_scheduler(num_blocks=2, policy="priority")
    low = add(scheduler, "low", 3, priority=9)
    first = schedule_ahead(scheduler)  # low: 3 prompt tokens, samples position 3
    add(scheduler, "high", 7, priority=0)  # needs both blocks
    second = schedule_ahead(scheduler)
    assert second[0].preempted_req_ids == {"low"}
    assert second[0].num_scheduled_tokens == {"high": 7}
    out = scheduler.update_from_output(*first)
    # The token low sampled before it was preempted is its own (the runner kept it).
    assert [o.new_token_ids for o in out.outputs] == [[1003]]
    assert low.output_token_ids == [1003] and low.num_output_placeholders == 0
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    scheduler.update_from_output(*second)
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        scheduler.update_from_output(*schedule_ahead(scheduler))
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_free(scheduler)
