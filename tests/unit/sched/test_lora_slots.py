"""The scheduler runs at most max_loras adapters in one step (engine/sched/scheduler.py
`_schedule_waiting`): a request of another adapter waits, keeping its place, while the
requests behind it of running adapters (or of the base) go ahead."""

from __future__ import annotations

import pytest

from engine.lora_request import LoRARequest
from engine.request import RequestStatus
from tests.support.scheduler import add, make_scheduler

A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))


def test_a_third_adapter_waits_for_a_slot_and_keeps_its_place():
    scheduler = make_scheduler(max_loras=2, max_num_batched_tokens=256)
    for req_id, lora in [("a", A), ("b", B), ("c", C), ("base", None), ("a2", A)]:
        add(scheduler, req_id, 8, lora_request=lora)
    output = scheduler.schedule()
    assert set(output.num_scheduled_tokens) == {"a", "b", "base", "a2"}
    assert [r.req_id for r in scheduler.waiting] == ["c"]
    assert {new.lora_request for new in output.scheduled_new_reqs} == {A, B, None}
    # The step stats name them as vLLM's lora_requests_info does (the base is not counted).
    stats = scheduler.make_stats()
    assert stats.running_lora_adapters == {"a": 2, "b": 1}
    assert stats.waiting_lora_adapters == {"c": 1}


def test_the_waiting_adapter_runs_once_a_slot_frees():
    scheduler = make_scheduler(max_loras=1, max_num_batched_tokens=256)
    add(scheduler, "a", 8, lora_request=A, max_tokens=1)
    add(scheduler, "b", 8, lora_request=B, max_tokens=1)
    assert set(scheduler.schedule().num_scheduled_tokens) == {"a"}
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert set(scheduler.schedule().num_scheduled_tokens) == {"b"}


def test_an_adapter_without_enable_lora_is_refused_not_queued():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="--enable-lora"):
        add(scheduler, "a", 8, lora_request=A)
    assert len(scheduler.waiting) == 0
