"""EngineCore: one step = schedule() -> execute_model() -> update_from_output().

Used in-process by the offline `LLM` API and tests, and inside its own process by
the server (see `engine/core_proc.py`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Protocol

from engine.config import EngineConfig
from engine.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput
from engine.request import EngineCoreRequest, RequestStatus
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.structured_output import StructuredOutputManager
from engine.xray import XrayLimits, XrayRecorder, XraySnapshot, build_snapshot

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheInfo:
    """What start-up found out about the model and its KV cache."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


class Executor(Protocol):
    """Runs the model. The real one is `engine.worker.executor.ModelExecutor`."""

    def initialize(self) -> KVCacheInfo: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class StepFaultInjector:
    """Test hook: `PAGEDSERVE_FAULT_STEPS=3,7` raises inside steps 3 and 7.

    Unset (the normal case) it does nothing.
    """

    def __init__(self) -> None:
        spec = os.environ.get("PAGEDSERVE_FAULT_STEPS", "")
        self.steps = {int(s) for s in spec.split(",") if s.strip()}

    def check(self, step_index: int) -> None:
        if step_index in self.steps:
            raise RuntimeError(f"injected fault in step {step_index} (PAGEDSERVE_FAULT_STEPS)")


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        if executor is None:
            from engine.worker.executor import make_executor

            executor = make_executor(config)
        self.config = config
        self.executor = executor
        self.kv_cache_info = executor.initialize()
        scheduler_config = replace(
            config.scheduler_config, max_model_len=self.kv_cache_info.max_model_len
        )
        cache_config = replace(config.cache_config, block_size=self.kv_cache_info.block_size)
        self.structured_output = StructuredOutputManager(
            functools.partial(_load_tokenizer, config.model_config.model),
            self.kv_cache_info.vocab_size)
        self.scheduler = Scheduler(scheduler_config, cache_config, self.kv_cache_info.num_blocks,
                                   structured_output=self.structured_output)
        self.num_steps = 0
        self._fault_injector = StepFaultInjector()
        self.xray = XrayRecorder(self.scheduler)  # what GET /xray shows; see engine/xray.py

    def add_request(self, request: EngineCoreRequest) -> None:
        self.xray.note_request(self.scheduler.add_request(request))

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        """Abort requests; their blocks are free when this returns."""
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Run one engine step. A failing model step fails only its own requests."""
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.xray.note_scheduled(scheduler_output)
        if scheduler_output.is_empty:
            if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                # Nothing to compute, but the runner must still forget finished requests.
                self.executor.execute_model(scheduler_output)
            return self.idle_outputs()
        self.num_steps += 1
        try:
            self._fault_injector.check(self.num_steps)
            runner_output = self.executor.execute_model(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            logger.exception("model step %d failed; failing its requests", self.num_steps)
            return self._fail_step(scheduler_output, f"{type(exc).__name__}: {exc}")
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if outputs.scheduler_stats is not None:
            outputs.scheduler_stats.step_duration_s = time.perf_counter() - started
            self.xray.record_step(self.num_steps, scheduler_output, outputs.scheduler_stats,
                                  len(self.scheduler.finished_req_ids))
        return outputs

    def idle_outputs(self) -> EngineCoreOutputs:
        """No outputs, just the current stats (for an idle engine's heartbeat)."""
        return EngineCoreOutputs(outputs=self.scheduler.take_grammar_failures(),
                                 scheduler_stats=self.scheduler.make_stats(), timestamp=time.time())

    def _fail_step(self, scheduler_output: SchedulerOutput, message: str) -> EngineCoreOutputs:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        failed = self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        outputs = [
            EngineCoreOutput(req_id, [], "error", error=f"engine step failed: {message}")
            for req_id in failed
        ]
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()
        )

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def xray_snapshot(self, limits: XrayLimits) -> XraySnapshot:
        """The scheduler, block pool, prefix cache and recent steps now (between steps)."""
        return build_snapshot(self, limits)

    def shutdown(self) -> None:
        self.structured_output.shutdown()
        self.executor.shutdown()


def _load_tokenizer(model: str):
    """The model's Hugging Face tokenizer (for grammar compiles; loaded on first use)."""
    from transformers import AutoTokenizer

    from engine.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model).path))
