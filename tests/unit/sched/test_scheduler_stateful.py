"""Random add / step / abort sequences against the scheduler and its KV cache.

A fake model runner keeps its own per-request state from the `SchedulerOutput`
diffs alone (as the real runner must) and a fake KV store. As in a real model, the
KV at position p stands for the whole prefix [0, p] (here: a digest of it, tagged
with the tenant's cache_salt). Each step the runner writes every scheduled token's
KV into its slot, then checks that every position a request attends to holds that
request's own KV. A wrong or cross-tenant prefix-cache hit, a stale hash, a block
freed too early or a bad block table shows up there as a mismatch.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.config import CacheConfig, SchedulerConfig
from engine.outputs import ModelRunnerOutput
from engine.request import EngineCoreRequest, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched import Scheduler, SchedulerOutput

BLOCK_SIZE = 4
EOS = 2
STOP_TOKEN = 5
ALPHABET = [3, 4, 5]  # prompt tokens; the runner samples these and EOS
# Shared documents: prompts start with a prefix of one, so prefixes are shared.
DOCS = [[3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3],
        [4, 4, 4, 4, 3, 3, 3, 3, 5, 5, 5, 5, 4, 4, 4, 4],
        [3, 4, 5, 3, 5, 5, 5, 5, 3, 3, 3, 3, 4, 4, 3, 3]]
MAX_PROMPT = 20
MAX_TOKENS = 12  # a request alone always fits: 32 tokens = 8 blocks <= the pool
MAX_DRAIN_STEPS = 2000

# What the runs exercised, summed over all examples (checked by the test below).
COVERAGE: Counter[str] = Counter()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    prefix_keys: list[int] = field(default_factory=list)

    def kv(self, pos: int) -> tuple[str | None, int]:
        """The fake KV of position `pos`: it depends on every token up to `pos`."""
        while len(self.prefix_keys) <= pos:
            parent = self.prefix_keys[-1] if self.prefix_keys else 0
            self.prefix_keys.append(hash((parent, self.token_ids[len(self.prefix_keys)])))
        return self.cache_salt, self.prefix_keys[pos]


class FakeRunner:
    """A model runner without a model: block tables, a fake KV store, a sampler."""

    def __init__(self, num_blocks: int, rng: random.Random):
        self.kv: list[list[tuple | None]] = [[None] * BLOCK_SIZE for _ in range(num_blocks)]
        self.requests: dict[str, RunnerRequest] = {}
        # The salt is not part of the runner's input; the test tells it, to tag the KV.
        self.cache_salts: dict[str, str | None] = {}
        self.rng = rng

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.requests
            self.requests[new.req_id] = RunnerRequest(
                list(new.prompt_token_ids), list(new.block_ids), new.num_computed_tokens,
                self.cache_salts[new.req_id],
            )
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]  # kept across preemption
            if cached.resumed_from_preemption[i]:
                state.block_ids = list(cached.new_block_ids[i])
            else:
                assert state.num_computed_tokens == cached.num_computed_tokens[i]
                state.block_ids.extend(cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        # Write the new tokens' KV first (every layer writes before it attends) ...
        written: dict[tuple[int, int], str] = {}
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            state = self.requests[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            assert 0 < num_tokens and end <= len(state.token_ids)
            assert cdiv(end, BLOCK_SIZE) <= len(state.block_ids)
            for pos in range(start, end):
                slot = (state.block_ids[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
                assert written.setdefault(slot, req_id) == req_id, "two requests, one slot"
                self.kv[slot[0]][slot[1]] = state.kv(pos)
        # ... then check everything each request attends to, and sample.
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            state.num_computed_tokens += out.num_scheduled_tokens[req_id]
            context = [self.kv[state.block_ids[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                       for pos in range(state.num_computed_tokens)]
            expected = [state.kv(pos) for pos in range(state.num_computed_tokens)]
            assert context == expected, f"{req_id} attends to KV that is not its own"
            if state.num_computed_tokens == len(state.token_ids):
                token = EOS if self.rng.random() < 0.05 else self.rng.choice(ALPHABET)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(8, 12),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(4, 24),
        chunked=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        rng=st.randoms(use_true_random=False),
    )
    def setup(self, num_blocks, max_num_seqs, budget, chunked, policy, rng):
        if not chunked:
            budget = 64  # must hold a whole context (max_model_len), or prompts could wait forever
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            policy=policy,
            max_model_len=64,
        )
        self.scheduler = Scheduler(self.config, CacheConfig(block_size=BLOCK_SIZE), num_blocks)
        self.runner = FakeRunner(num_blocks, rng)
        self.rng = rng
        self.next_id = 0
        self.known_ids: list[str] = []

    # ------------------------------------------------------------ rules
    @rule(
        doc=st.sampled_from(DOCS),
        prefix_len=st.integers(0, len(DOCS[0])),
        tail=st.lists(st.sampled_from(ALPHABET), max_size=8),
        max_tokens=st.integers(1, MAX_TOKENS),
        min_tokens=st.integers(0, 2),
        cache_salt=st.sampled_from([None, None, "tenant-b"]),
        priority=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop=st.sampled_from([False, False, False, True]),
    )
    def add(self, doc, prefix_len, tail, max_tokens, min_tokens, cache_salt, priority,
            ignore_eos, stop):
        prompt = (doc[:prefix_len] + tail)[:MAX_PROMPT] or [3]
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=[STOP_TOKEN] if stop else [],
        )
        req_id = f"r{self.next_id}"
        self.next_id += 1
        self.known_ids.append(req_id)
        self.runner.cache_salts[req_id] = cache_salt
        self.scheduler.add_request(EngineCoreRequest(
            req_id, prompt, params, eos_token_id=EOS, priority=priority,
            cache_salt=cache_salt,
        ))
        COVERAGE["requests"] += 1

    @rule(num_steps=st.integers(1, 3), abort_mid_step=st.integers(0, 9))
    def steps(self, num_steps, abort_mid_step):
        for i in range(num_steps):
            self.step(abort_mid_step=abort_mid_step + i)

    def step(self, abort_mid_step: int = 1) -> None:
        """One engine step; when `abort_mid_step == 0` an abort lands while the model runs."""
        scheduler = self.scheduler
        before = {r.req_id: r.num_computed_tokens
                  for r in [*scheduler.running, *scheduler.waiting]}
        out = scheduler.schedule()
        self.check_schedule(out, before)
        runner_output = self.runner.execute(out)
        if abort_mid_step == 0 and out.num_scheduled_tokens:
            victim = self.rng.choice(list(out.num_scheduled_tokens))
            assert scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            COVERAGE["aborts_mid_step"] += 1
        engine_out = scheduler.update_from_output(out, runner_output)
        stats = engine_out.scheduler_stats
        assert stats.num_preemptions == len(out.preempted_req_ids)
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
        COVERAGE["prefix_hit_tokens"] += stats.prefix_cache_hits
        COVERAGE["finished"] += sum(1 for o in engine_out.outputs if o.finished)
        self.check_runner_agrees()

    @precondition(lambda self: self.known_ids)
    @rule(data=st.data())
    def abort(self, data):
        req_ids = data.draw(st.lists(st.sampled_from(self.known_ids), max_size=3))
        live = [r for r in dict.fromkeys(req_ids) if r in self.scheduler.requests]
        finished = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        assert finished == live
        COVERAGE["aborts"] += len(finished)

    def teardown(self):
        """Run until every request has finished; then every block must be free."""
        if not hasattr(self, "scheduler"):
            return
        for _ in range(MAX_DRAIN_STEPS):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
            self.block_accounting()
        assert not self.scheduler.has_unfinished_requests(), "requests did not finish"
        self.check_all_free()
        COVERAGE["drained"] += 1

    # ------------------------------------------------------------ checks
    def check_schedule(self, out: SchedulerOutput, before: dict[str, int]) -> None:
        config = self.config
        scheduler = self.scheduler
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= config.max_num_seqs
        assert len(scheduler.running) <= config.max_num_seqs
        assert not (out.preempted_req_ids & out.num_scheduled_tokens.keys())
        cached = out.scheduled_cached_reqs
        assert (len(cached.resumed_from_preemption) == len(cached.new_block_ids)
                == len(cached.num_computed_tokens) == cached.num_reqs)
        admitted = [r.req_id for r in out.scheduled_new_reqs] + [
            req_id
            for req_id, resumed in zip(cached.req_ids, cached.resumed_from_preemption,
                                       strict=True)
            if resumed
        ]
        if out.preempted_req_ids:
            COVERAGE["steps_with_preemption"] += 1
            if admitted:
                # Only a waiting request that outranks every victim preempts (priority).
                assert config.policy == "priority", "fcfs admitted in a preempting step"
                victims = [scheduler.requests[r].priority for r in out.preempted_req_ids]
                assert max(scheduler.requests[r].priority for r in admitted) < min(victims)
                COVERAGE["admissions_that_preempted"] += 1
        for req_id in out.preempted_req_ids:
            request = scheduler.requests[req_id]
            assert request.status == RequestStatus.PREEMPTED
            assert request.num_computed_tokens == 0
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            assert request.status == RequestStatus.RUNNING
            computed_before = request.num_computed_tokens - num_tokens
            assert 0 < num_tokens <= request.num_tokens - computed_before
            if req_id in admitted:
                COVERAGE["prefix_hit_admissions"] += computed_before > 0
                if not config.enable_chunked_prefill:
                    assert computed_before + num_tokens == request.num_tokens
            else:
                assert computed_before == before[req_id]

    def check_runner_agrees(self) -> None:
        """The runner's view, built from diffs only, equals the scheduler's."""
        manager = self.scheduler.kv_cache_manager
        for request in self.scheduler.running:
            state = self.runner.requests[request.req_id]
            assert state.token_ids == request.all_token_ids
            assert state.block_ids == manager.get_block_ids(request.req_id)
            assert state.num_computed_tokens == request.num_computed_tokens

    @invariant()
    def block_accounting(self):
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        manager = scheduler.kv_cache_manager
        pool = manager.block_pool
        holders = Counter(block.block_id for blocks in manager.req_to_blocks.values()
                          for block in blocks)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], block
        free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free_ids) == len(set(free_ids)) == pool.get_num_free_blocks()
        assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.get_cached_block(block.block_hash) is block
        # Only running requests hold blocks, enough for their computed tokens.
        running_ids = {r.req_id for r in scheduler.running}
        assert set(manager.req_to_blocks) <= running_ids
        for request in scheduler.running:
            num_blocks = len(manager.req_to_blocks.get(request.req_id, []))
            assert num_blocks >= cdiv(request.num_computed_tokens, BLOCK_SIZE)
        waiting = list(scheduler.waiting)
        assert {r.req_id for r in waiting} | running_ids == set(scheduler.requests)
        assert len(waiting) + len(running_ids) == len(scheduler.requests)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                   and r.num_computed_tokens == 0 for r in waiting)
        if not scheduler.has_unfinished_requests():
            self.check_all_free()

    def check_all_free(self) -> None:
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        assert manager.req_to_blocks == {}
        assert all(block.ref_cnt == 0 for block in pool.blocks)
        assert pool.get_num_free_blocks() == pool.num_blocks
        assert manager.usage == 0.0


def test_scheduler_state_machine():
    COVERAGE.clear()
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=120,
            stateful_step_count=40,
            derandomize=True,  # the same sequences every run: no flaky coverage checks
            report_multiple_bugs=False,  # shrink one failure, not several (minutes each)
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # The runs must have reached the interesting paths, or they checked little.
    assert COVERAGE["steps_with_preemption"] > 0, COVERAGE
    assert COVERAGE["prefix_hit_admissions"] > 0, COVERAGE
    assert COVERAGE["aborts"] > 0 and COVERAGE["aborts_mid_step"] > 0, COVERAGE
    assert COVERAGE["drained"] > 0, COVERAGE
