"""EngineCore: one step = schedule() -> execute_model() -> update_from_output().

Used in-process by the offline `LLM` API and tests, and inside its own process by
the server (see `engine/core/core_proc.py`).

With async scheduling (`SchedulerConfig.async_scheduling`) the model runs on a
worker thread and the core keeps one step ahead of it:

    core thread:   schedule N+1 | wait N | update N, outputs N | schedule N+2 | wait N+1 ...
    worker thread: ....... run N ........|........ run N+1 ..........|.... run N+2

so a step's period approaches max(model, engine work) instead of their sum. Step
N+1 is scheduled before N's tokens are known: a request sampling in N holds a
placeholder (Request.num_output_placeholders) and N+1 may already compute that
position, because the runner executes steps in order and has N's token by then.
A request that N finishes (EOS, stop token) computes one extra token in N+1, which
is never reported.

Speculative decoding needs each request's last token to look its draft up, so while
the scheduler `may_draft()` (few requests run and one of them may speculate) the core
applies the steps in flight and then runs steps one at a time, as without async
scheduling; with many requests running nobody drafts and steps overlap again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.core.kv_events import ZmqEventPublisher
from engine.core.xray import XrayRecorder, build_snapshot
from engine.executor.abstract import Executor, make_executor
from engine.kv_cache.events import KVEventLog
from engine.model_loader.resources import load_tokenizer
from engine.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput
from engine.request import EngineCoreRequest, RequestStatus
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.structured_output import StructuredOutputManager, StructuredOutputsParams
from engine.xray_schema import XrayLimits, XraySnapshot

logger = logging.getLogger(__name__)


@dataclass
class _StepInFlight:
    """A step handed to the worker thread (async scheduling), not yet applied."""

    index: int
    scheduler_output: SchedulerOutput
    result: Future[ModelRunnerOutput]
    scheduled_at: float  # time.perf_counter()


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None):
        if executor is None:
            executor = make_executor(config)
        self.config = config
        self.executor = executor
        self.kv_cache_info = executor.initialize()
        scheduler_config = replace(
            config.scheduler_config, max_model_len=self.kv_cache_info.max_model_len
        )
        cache_config = replace(config.cache_config, block_size=self.kv_cache_info.block_size)
        self.structured_output = StructuredOutputManager(
            functools.partial(load_tokenizer, config.model_config.model),  # on first use
            self.kv_cache_info.vocab_size)
        self.scheduler = Scheduler(scheduler_config, cache_config, self.kv_cache_info.num_blocks,
                                   structured_output=self.structured_output,
                                   speculative_config=config.speculative_config,
                                   kv_cache_groups=self.kv_cache_info.kv_cache_groups,
                                   max_loras=(config.lora_config.max_loras
                                              if config.lora_config.enable_lora else 0))
        self.num_steps = 0  # steps scheduled with work
        self.num_steps_applied = 0  # of those, steps whose results are applied
        self._in_flight: deque[_StepInFlight] = deque()
        self._worker = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-step")
                        if scheduler_config.async_scheduling else None)
        self.xray = XrayRecorder(self.scheduler)  # what GET /xray shows; see engine/core/xray.py
        # --kv-events-config: the block pool logs, each step's events are published.
        self.kv_events: ZmqEventPublisher | None = None
        events_config = config.kv_events_config
        if events_config is not None and events_config.enabled:
            pool = self.scheduler.kv_cache_manager.block_pool
            pool.events = KVEventLog(cache_config.block_size)
            self.kv_events = ZmqEventPublisher(events_config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.xray.note_request(self.scheduler.add_request(request))

    def abort_requests(self, req_ids: list[str]) -> list[str]:
        """Abort requests; their blocks are free when this returns."""
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or (async scheduling) steps still to apply."""
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> EngineCoreOutputs:
        """Run one engine step. A failing model step fails only its own requests."""
        outputs = self._step()
        self._publish_kv_events()  # what applying the step changed (blocks cached, evicted)
        return outputs

    def _publish_kv_events(self) -> None:
        """Send the block pool's prefix-cache changes since the last call. Called right after
        each schedule() too, as vLLM's scheduler does: blocks are cached when allocated, so a
        router learns of a prompt's blocks before its prefill runs (a long prefill on a CPU
        runs for seconds), and sends that prompt's followers here meanwhile."""
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv_cache_manager.block_pool.events.take())

    def _step(self) -> EngineCoreOutputs:
        if self._worker is None:
            return self._step_sync(self.executor.execute_model)
        if self.scheduler.speculator is not None:
            # Drafts need the last tokens: no step is scheduled behind one that may
            # draft or that carries drafts (its rejected drafts roll back when applied).
            may_draft = self.scheduler.may_draft()
            if self._in_flight and (may_draft or any(
                    s.scheduler_output.scheduled_spec_decode_tokens for s in self._in_flight)):
                return self._apply_oldest()
            if may_draft:
                return self._step_sync(lambda output: self._submit(output).result())
        return self._step_async()

    def _step_sync(self, execute_model: Callable[[SchedulerOutput], ModelRunnerOutput]
                   ) -> EngineCoreOutputs:
        """Schedule, run and apply one step (`execute_model` runs it and returns)."""
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self._publish_kv_events()
        self.xray.note_scheduled(scheduler_output)
        if scheduler_output.is_empty:
            if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                # Nothing to compute, but the runner must still forget finished requests.
                execute_model(scheduler_output)
            return self.idle_outputs()
        self.num_steps += 1
        try:
            runner_output = execute_model(scheduler_output)
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            logger.exception("model step %d failed; failing its requests", self.num_steps)
            return self._fail_step(scheduler_output, f"{type(exc).__name__}: {exc}")
        return self._apply(self.num_steps, scheduler_output, runner_output, started)

    def _apply(self, index: int, scheduler_output: SchedulerOutput,
               runner_output: ModelRunnerOutput, scheduled_at: float) -> EngineCoreOutputs:
        """Step `index`'s sampled tokens -> requests, stop checks, outputs, stats."""
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_steps_applied += 1
        if outputs.scheduler_stats is not None:
            outputs.scheduler_stats.step_duration_s = time.perf_counter() - scheduled_at
            self.xray.record_step(index, scheduler_output, outputs.scheduler_stats,
                                  len(self.scheduler.finished_req_ids))
        return outputs

    def _step_async(self) -> EngineCoreOutputs:
        """Schedule the next step and queue it behind the running one, then apply the
        oldest step in flight. The first call after idle only starts a step: it
        returns no outputs, so that the next call can schedule behind it."""
        scheduled_at = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self._publish_kv_events()
        self.xray.note_scheduled(scheduler_output)
        started_pipeline = False
        if not scheduler_output.is_empty:
            self.num_steps += 1
            started_pipeline = not self._in_flight
            self._in_flight.append(_StepInFlight(
                self.num_steps, scheduler_output, self._submit(scheduler_output),
                scheduled_at))
        elif scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
            self._submit(scheduler_output)  # the runner forgets them, in step order
        if started_pipeline or not self._in_flight:
            return self.idle_outputs()
        return self._apply_oldest()

    def _apply_oldest(self) -> EngineCoreOutputs:
        """Wait for the oldest step in flight and apply it."""
        step = self._in_flight.popleft()
        try:
            runner_output = step.result.result()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            logger.exception("model step %d failed; failing its requests", step.index)
            self.num_steps_applied += 1
            return self._fail_step(step.scheduler_output, f"{type(exc).__name__}: {exc}")
        return self._apply(step.index, step.scheduler_output, runner_output, step.scheduled_at)

    def _submit(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Run a step on the worker thread (steps run one at a time, in order)."""
        return self._worker.submit(self.executor.execute_model, scheduler_output)

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

    def check_grammar(self, params: StructuredOutputsParams,
                      on_done: Callable[[str | None], None]) -> None:
        """Compile `params` in the grammar threads; `on_done(error or None)` when done."""
        self.structured_output.check(params, on_done)

    def reset_prefix_cache(self) -> bool:
        done = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return done

    def xray_snapshot(self, limits: XrayLimits) -> XraySnapshot:
        """The scheduler, block pool, prefix cache and recent steps now (between steps)."""
        return build_snapshot(self.scheduler, self.xray, self.num_steps, limits)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)  # let the step in flight end first
        self.structured_output.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.executor.shutdown()
