"""Counting what speculative decoding did in an engine (tests/engine/test_spec_*.py)."""

from __future__ import annotations

from engine import LLM


class SpecCounts:
    """Totals of the engine's spec-decode stats (draft tokens verified, accepted, cut by
    the grammar) and of rollbacks that freed blocks."""

    def __init__(self, llm: LLM):
        self.draft_tokens = self.accepted = self.rollbacks_freeing_blocks = 0
        self.grammar_cut_tokens = 0
        core, scheduler = llm.engine_core, llm.engine_core.scheduler
        step, schedule = core.step, scheduler.schedule

        def counted_step():
            outputs = step()
            stats = outputs.scheduler_stats
            self.draft_tokens += stats.spec_num_draft_tokens
            self.accepted += stats.spec_num_accepted_tokens
            self.grammar_cut_tokens += stats.spec_num_grammar_cut_tokens
            return outputs

        def counted_schedule():
            output = schedule()
            self.rollbacks_freeing_blocks += len(output.num_blocks_after_rollback)
            return output

        core.step, scheduler.schedule = counted_step, counted_schedule


def assert_all_blocks_free(llm: LLM) -> None:
    manager = llm.engine_core.scheduler.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.num_blocks
    assert manager.req_to_blocks == {}


def note_steps_in_flight(llm: LLM) -> list[tuple[int, bool]]:
    """Wraps the scheduler: one (steps in flight when it was scheduled, carries drafts)
    per non-empty step from now on, in the returned list (async scheduling's rule: a step
    with drafts is scheduled with nothing in flight)."""
    core = llm.engine_core
    schedule, scheduled = core.scheduler.schedule, []

    def schedule_noting_steps_in_flight():
        output = schedule()
        if not output.is_empty:
            scheduled.append((len(core._in_flight), bool(output.scheduled_spec_decode_tokens)))
        return output

    core.scheduler.schedule = schedule_noting_steps_in_flight
    return scheduled
