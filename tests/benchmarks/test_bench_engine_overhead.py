"""benchmarks/engine_overhead.py runs its real loop end to end (counts only, no timings)."""

from __future__ import annotations

from benchmarks.engine_overhead import Workload, run_core, run_frontend
from engine.ipc import frontend_codec


def test_core_loop_and_frontend_playback():
    recorded: list[bytes] = []
    result = run_core(Workload("decode-8", 8, "greedy"), num_steps=10, model_ms=0.0,
                      record=recorded, prompt_len=40)
    # Every timed step decoded one token for each of the 8 running requests.
    assert len(recorded) == 10
    codec = frontend_codec()
    steps = [codec.decode(data).outputs for data in recorded]
    assert all(len(s.outputs) == 8 and all(len(o.new_token_ids) == 1 for o in s.outputs)
               for s in steps)
    stages = result.stages_us
    overhead = ("schedule", "update_from_output", "runner_bookkeeping", "encode_send")
    assert all(stages[name] >= 0 for name in (*overhead, "sampler_math", "model_stub"))
    assert abs(stages["core_overhead_total"] - sum(stages[n] for n in overhead)) < 1.0
    # The frontend streams every recorded token to its consumer.
    frontend = run_frontend(recorded, num_streams=8)
    assert frontend.tokens == 80 and frontend.num_steps == 10


def test_mixed_sampling_and_prefill_mix_run():
    result = run_core(Workload("mix-8", 8, "mixed", with_prefill=True), num_steps=6,
                      model_ms=0.0, prompt_len=40, clock="cpu")
    assert result.num_running == 8 and result.tokens_per_s > 0 and result.clock == "cpu"


def test_async_scheduling_run_applies_one_step_per_call():
    recorded: list[bytes] = []
    result = run_core(Workload("decode-8", 8, "greedy"), num_steps=6, model_ms=1.0,
                      record=recorded, prompt_len=40, async_scheduling=True)
    codec = frontend_codec()
    steps = [codec.decode(data).outputs for data in recorded]
    assert result.async_scheduling and len(steps) == 6
    assert all(len(s.outputs) == 8 and all(len(o.new_token_ids) == 1 for o in s.outputs)
               for s in steps)
