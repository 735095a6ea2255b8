"""AsyncEngine: the frontend's asyncio engine over an engine-core client.

    generate(prompt, params, req_id)          one output-handler task
      validate, fan out n sequences  ──▶ core    core outputs ──▶ detokenize, stop strings
      await the request's event      ◀────────── mark the request changed, set its event
      yield RequestOutput (deltas)               stop string matched ──▶ abort in the core

Each request's consumer collects everything that arrived since it last looked, so a
slow consumer gets bigger deltas rather than falling behind. Detokenization runs in
this process, never in the core. A request with `n > 1` becomes n core requests
`"{req_id}-{i}"` whose seeds derive from the request's seed (`derive_seed`). The
Processor (prompt checks, fan-out) and the OutputProcessor (detokenize, stops,
logprobs) are the offline LLM's too; this class adds the streams, aborts, health and
the observer around them.

`add_request()` queues a request at once and returns its `RequestStream`; `generate()`
is the same as one async generator. Leaving a stream early (aclose, an exception, a
cancelled consumer) aborts every sequence of its request in the core, which frees
their KV blocks in its next loop turn. `num_queued_sequences` counts the sequences the
core has not scheduled yet (admission control reads it); `check_health()` pings the
core's busy loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Protocol

from engine.config import EngineConfig
from engine.executor.abstract import ExecutorSpec
from engine.frontend.core_client import (
    DEFAULT_STARTUP_TIMEOUT_S,
    AsyncEngineCoreClient,
    EngineDeadError,
    start_async_client,
)
from engine.frontend.output_processor import OutputProcessor, RequestState
from engine.frontend.processor import Processor
from engine.lora_request import LoRARequest
from engine.multimodal.inputs import ImageFeature
from engine.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from engine.pooling_params import PoolingParams
from engine.request_output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams
from engine.xray_schema import XrayLimits, XraySnapshot

logger = logging.getLogger(__name__)

# Outputs processed between two yields to the event loop, so HTTP handling and SSE
# writes interleave with a big batch's detokenization.
_OUTPUT_CHUNK = 128
# A pooling request samples nothing; these only satisfy the prompt checks.
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
# check_health(): how long the core's loop may take to answer a Ping (it answers
# between two steps), and, when it does not answer in time, for how long a core that
# is busy (a step's outputs arrived, or it was just given work) still counts as alive.
HEALTH_PING_TIMEOUT_S = 0.03
HEALTH_STEP_TIMEOUT_S = 60.0
# A core with nothing to do answers at once; one that has not (a loaded machine) gets
# this much longer before it counts as stuck.
_IDLE_PING_GRACE_S = 1.0
# A message from the core's loop (a step's outputs, a Pong) this recent is proof
# enough: no Ping needed, so a busy engine's health check costs nothing.
_FRESH_MESSAGE_S = 1.0


class EngineRequestError(RuntimeError):
    """The engine failed this request (e.g. its model step raised).

    `engine_dead`: the request failed because the whole engine died under it.
    """

    def __init__(self, message: str, *, engine_dead: bool = False):
        super().__init__(message)
        self.engine_dead = engine_dead


class EngineUnresponsiveError(RuntimeError):
    """The engine core neither answered a ping nor made progress for too long."""


class EngineObserver(Protocol):
    """Receives the engine's statistics (the server's metrics implement this)."""

    def on_step(self, stats: SchedulerStats) -> None: ...

    def on_request_finished(self, output: RequestOutput, error: str | None) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator (the last one has `finished`).

    Raises EngineRequestError if the engine fails the request (with `engine_dead` set
    when the engine died meanwhile). `aclose()`, or leaving `__anext__` by an exception
    or a cancellation, aborts the request if it is still unfinished.
    """

    def __init__(self, engine: AsyncEngine, state: RequestState):
        self._engine = engine
        self._state = state
        self._done = False

    @property
    def req_id(self) -> str:
        return self._state.req_id

    @property
    def finished(self) -> bool:
        return self._state.finished

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        state = self._state
        try:
            await state.changed.wait()
        except BaseException:
            self._close()
            raise
        state.changed.clear()
        if state.error is not None:
            self._done = True
            raise EngineRequestError(state.error, engine_dead=state.engine_dead)
        output = OutputProcessor.make_output(state)
        if output.finished:
            self._done = True
        return output

    async def final_output(self) -> RequestOutput | None:
        """Iterate to the end (a pooling request has one output); the last output, or
        None if it ended without one. Raises as iterating does."""
        last = None
        async for output in self:
            last = output
        return last

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        self._done = True
        if not self._state.finished:
            self._engine._abort_state(self._state)


class AsyncEngine:
    """Serves `generate()` streams over an async engine-core client.

    `tokenizer` is a Hugging Face tokenizer; `eos_token_id` is passed to the core.
    """

    def __init__(
        self,
        client: AsyncEngineCoreClient,
        tokenizer: Any,
        *,
        eos_token_id: int | None = None,
        observer: EngineObserver | None = None,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.observer = observer
        self.kv_cache_info = client.kv_cache_info
        self.max_model_len = client.kv_cache_info.max_model_len
        # The embedding may be padded beyond the tokenizer; ids past both are invalid.
        self.vocab_size = client.kv_cache_info.vocab_size
        self.processor = Processor(tokenizer, self.max_model_len, self.vocab_size, eos_token_id)
        self.output_processor = OutputProcessor(tokenizer)
        self.token_text = self.output_processor.token_text
        self._requests = self.output_processor.requests
        self._sequences = self.output_processor.sequences
        # Core request ids added but not yet scheduled (no output, no scheduled time).
        self._unscheduled: set[str] = set()
        # time.monotonic() when the core last went from no requests to some (health).
        self._busy_since = 0.0
        self._output_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.dead_error: str | None = None

    @classmethod
    async def start(
        cls,
        config: EngineConfig,
        tokenizer: Any,
        *,
        eos_token_id: int | None = None,
        observer: EngineObserver | None = None,
        executor_spec: ExecutorSpec | None = None,
        mode: Literal["process", "thread"] = "process",
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        log_level: str = "INFO",
    ) -> AsyncEngine:
        """Start the engine core (raises EngineStartupError) and the output handler."""
        client = await start_async_client(config, executor_spec, mode, startup_timeout_s,
                                          log_level)
        return cls.from_client(client, tokenizer, eos_token_id=eos_token_id, observer=observer)

    @classmethod
    def from_client(cls, client: AsyncEngineCoreClient, tokenizer: Any, *,
                    eos_token_id: int | None = None,
                    observer: EngineObserver | None = None) -> AsyncEngine:
        """The frontend over an engine core already started (`start_async_client`), with
        its output handler running; call from the event loop."""
        engine = cls(client, tokenizer, eos_token_id=eos_token_id, observer=observer)
        engine._ensure_output_task()
        return engine

    # ------------------------------------------------------------------ requests
    @property
    def is_running(self) -> bool:
        return self.dead_error is None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    @property
    def num_queued_sequences(self) -> int:
        """Sequences added to the core that it has not scheduled yet."""
        return len(self._unscheduled)

    @property
    def unfinished_req_ids(self) -> list[str]:
        return list(self._requests)

    async def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams,
        req_id: str,
        *,
        prompt_text: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; the last one has `finished`.

        `prompt` is text (tokenized here, with the tokenizer's special tokens) or token
        ids; `mm_features` are its images (the ids then hold their placeholder runs:
        engine/multimodal/processor.py). Raises PromptError / SamplingParamsError before
        anything is queued, EngineRequestError if the engine fails the request,
        EngineDeadError if the engine is gone. Closing the iterator early aborts it.
        """
        stream = await self.add_request(
            prompt, sampling_params, req_id, prompt_text=prompt_text, priority=priority,
            cache_salt=cache_salt, arrival_time=arrival_time, lora_request=lora_request,
            mm_features=mm_features)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()  # the consumer left early (closed, cancelled, raised)

    async def encode(
        self,
        prompt: str | Sequence[int],
        pooling_params: PoolingParams,
        req_id: str,
        *,
        priority: int = 0,
    ) -> RequestOutput | None:
        """A pooling request (embeddings): its prompt computed in one step, its finished
        output's `pooled` the vector. Errors as `generate`'s; cancelling the await aborts
        it."""
        stream = await self.add_request(prompt, POOLING_SAMPLING_PARAMS, req_id,
                                        priority=priority, pooling_params=pooling_params)
        try:
            return await stream.final_output()
        finally:
            await stream.aclose()

    async def add_request(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams,
        req_id: str,
        *,
        prompt_text: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        mm_features: list[ImageFeature] | None = None,
    ) -> RequestStream:
        """Queue a request now and return its stream (see `generate` for the errors).

        The caller owns the stream: it must iterate it to the end or `aclose()` it.
        """
        state = await self._add_request(prompt, sampling_params, req_id, prompt_text,
                                        priority, cache_salt, arrival_time, pooling_params,
                                        lora_request, mm_features)
        return RequestStream(self, state)

    def abort_request(self, req_id: str) -> bool:
        """Abort a request; its stream ends with finish_reason "abort". Unknown or
        finished ids: a no-op. True if the request was unfinished."""
        state = self._requests.get(req_id)
        if state is None:
            return False
        self._abort_state(state)
        return True

    async def _add_request(self, prompt, params, req_id, prompt_text, priority, cache_salt,
                           arrival_time, pooling_params=None, lora_request=None,
                           mm_features=None) -> RequestState:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
        processed = self.processor.process_inputs(
            req_id, prompt, params, arrival_time if arrival_time is not None else time.time(),
            prompt_text=prompt_text, priority=priority, cache_salt=cache_salt,
            pooling_params=pooling_params, lora_request=lora_request, mm_features=mm_features)
        self._ensure_output_task()
        if not self._requests:
            self._busy_since = time.monotonic()
        state = self.output_processor.add_request(processed)
        for seq in state.sequences:
            self._unscheduled.add(seq.core_req_id)
        try:
            for core_request in processed.core_requests:
                await self.client.add_request_async(core_request)
        except BaseException:
            self._abort_state(state)
            raise
        return state

    def _abort_state(self, state: RequestState) -> None:
        core_req_ids = []
        for seq in state.sequences:
            if not seq.finished:
                seq.finish("abort")
                core_req_ids.append(seq.core_req_id)
        self._forget(state)
        state.changed.set()
        if core_req_ids and self.dead_error is None:
            self._spawn(self.client.abort_requests_async(core_req_ids))

    def _forget(self, state: RequestState) -> None:
        if not self.output_processor.remove_request(state):
            return
        for seq in state.sequences:
            self._unscheduled.discard(seq.core_req_id)
        state.metrics.finished_time = time.time()
        if self.observer is not None:
            try:
                self.observer.on_request_finished(OutputProcessor.snapshot(state), state.error)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                logger.exception("observer.on_request_finished failed")

    def _spawn(self, coroutine) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a stream closed after its loop ended: nothing left to abort
            coroutine.close()
            return
        task = loop.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ outputs
    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            if self.dead_error is None:
                self._output_task = asyncio.get_running_loop().create_task(
                    self._output_loop(), name="engine-output-handler")

    async def _output_loop(self) -> None:
        try:
            while True:
                core_outputs = await self.client.get_output_async()
                await self._process_outputs(core_outputs)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self._fail_everything(str(exc))
        except BaseException as exc:  # noqa: BLE001
            logger.exception("engine output handler failed")
            self._fail_everything(f"engine output handler failed: {type(exc).__name__}: {exc}")

    async def _process_outputs(self, core_outputs: EngineCoreOutputs) -> None:
        now = time.time()
        for req_id, scheduled_time in core_outputs.scheduled_times.items():
            self._unscheduled.discard(req_id)
            entry = self._sequences.get(req_id)
            if entry is not None and entry[0].metrics.first_scheduled_time is None:
                entry[0].metrics.first_scheduled_time = scheduled_time
        to_abort: list[str] = []
        outputs = core_outputs.outputs
        for start in range(0, len(outputs), _OUTPUT_CHUNK):
            if start:
                await asyncio.sleep(0)
            for core_output in outputs[start:start + _OUTPUT_CHUNK]:
                self._process_one(core_output, now, to_abort)
        if to_abort and self.dead_error is None:
            await self.client.abort_requests_async(to_abort)
        if self.observer is not None and core_outputs.scheduler_stats is not None:
            try:
                self.observer.on_step(core_outputs.scheduler_stats)
            except Exception:  # noqa: BLE001
                logger.exception("observer.on_step failed")

    def _process_one(self, core_output: EngineCoreOutput, now: float, to_abort: list[str]) -> None:
        self._unscheduled.discard(core_output.req_id)
        state = self.output_processor.process_output(core_output, now, to_abort)
        if state is None:
            return  # aborted meanwhile
        if state.finished:
            self._forget(state)
        state.changed.set()

    def _fail_everything(self, message: str) -> None:
        logger.error("engine is dead: %s; failing its %d unfinished request(s), refusing "
                     "new ones", message, len(self._requests))
        self.dead_error = message
        for state in list(self._requests.values()):
            state.error = message
            state.engine_dead = True
            for seq in state.sequences:
                seq.finish("error")
            self._forget(state)
            state.changed.set()

    # ------------------------------------------------------------------ control
    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility_async("reset_prefix_cache"))

    async def check_grammar(self, params: StructuredOutputsParams) -> str | None:
        """None if the engine core compiles `params`, else what the grammar library
        refused (the compile is cached for the request that follows)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        return await self.client.check_grammar_async(params)

    async def xray_snapshot(self, limits: XrayLimits) -> XraySnapshot:
        """The engine core's queues, block pool, prefix cache and recent steps
        (engine/core/xray.py)."""
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        return await self.client.xray_snapshot_async(limits)

    def sequence_text(self, core_req_id: str) -> tuple[str | None, list[int], str] | None:
        """(prompt text or None if it came as token ids, prompt token ids, output text so
        far) of an unfinished core request, or None if this engine does not know it."""
        entry = self._sequences.get(core_req_id)
        if entry is None:
            return None
        state, seq = entry
        return state.prompt, state.prompt_token_ids, seq.detokenizer.get_text(finished=False)

    async def check_health(
        self,
        ping_timeout_s: float = HEALTH_PING_TIMEOUT_S,
        step_timeout_s: float = HEALTH_STEP_TIMEOUT_S,
    ) -> None:
        """Return if the engine core is serving; raise EngineDeadError if it is gone,
        EngineUnresponsiveError if it is stuck.

        Serving means the core's busy loop shows progress, through the same sockets and
        loop that requests take:
          * it sent something (a step's outputs, a Pong) within the last second; or
          * it answers a Ping within `ping_timeout_s` (it answers between two steps); or
          * it has requests and is in a step longer than that, begun or last finished
            within `step_timeout_s` (with a core shared by several frontends: any
            requests, of any frontend; the core sends every frontend every step).
        An idle core answers at once; one that has not gets another second's grace
        before it counts as stuck. Takes about `ping_timeout_s` at most otherwise.
        """
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        self.client.check_alive()  # a dead process is reported now, not at the next poll
        if time.monotonic() - self.client.last_message_time < _FRESH_MESSAGE_S:
            return
        if await self.client.ping_async(ping_timeout_s):
            return
        if self._requests or self.client.shares_core:
            quiet_s = time.monotonic() - max(self.client.last_message_time, self._busy_since)
            if quiet_s <= step_timeout_s:
                return  # busy with a long step
        if await self.client.ping_async(_IDLE_PING_GRACE_S):
            return
        quiet_s = time.monotonic() - self.client.last_message_time
        what = "finished a step" if self._requests else "answered a ping while idle"
        raise EngineUnresponsiveError(f"the engine core has not {what} for {quiet_s:.1f} s")

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self.client.shutdown()
