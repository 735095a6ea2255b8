"""AsyncEngine: the frontend's asyncio engine over an engine-core client.

    generate(prompt, params, req_id)          one output-handler task
      validate, fan out n sequences  ──▶ core    core outputs ──▶ detokenize, stop strings
      await the request's event      ◀────────── mark the request changed, set its event
      yield RequestOutput (deltas)               stop string matched ──▶ abort in the core

Each request's consumer collects everything that arrived since it last looked, so a
slow consumer gets bigger deltas rather than falling behind. Detokenization runs in
this process, never in the core. A request with `n > 1` becomes n core requests
`"{req_id}-{i}"` whose seeds derive from the request's seed (`derive_seed`).

`add_request()` queues a request at once and returns its `RequestStream`; `generate()`
is the same as one async generator. Leaving a stream early (aclose, an exception, a
cancelled consumer) aborts every sequence of its request in the core, which frees
their KV blocks in its next loop turn. `num_queued_sequences` counts the sequences the
core has not scheduled yet (admission control reads it); `check_health()` pings the
core's busy loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from engine.frontend.detokenizer import IncrementalDetokenizer, TokenTextCache
from engine.frontend.processor import check_prompt
from engine.outputs import EngineCoreOutput, EngineCoreOutputs, Logprobs, SchedulerStats
from engine.request import EngineCoreRequest
from engine.request_output import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SampleLogprob,
    TopLogprob,
)
from engine.sampling_params import SamplingParams
from engine.xray_schema import XrayLimits, XraySnapshot

logger = logging.getLogger(__name__)

# Outputs processed between two yields to the event loop, so HTTP handling and SSE
# writes interleave with a big batch's detokenization.
_OUTPUT_CHUNK = 128
_SEED_MASK = (1 << 63) - 1
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


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of sequence `index` of a request: index 0 keeps the seed, the rest differ.

    Deterministic (splitmix64 of seed and index), so one seed gives the same n samples
    every time, and n different ones.
    """
    if seed is None or index == 0:
        return seed
    z = (seed + 0x9E3779B97F4A7C15 * index) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _SEED_MASK


class _SequenceState:
    """One of a request's n sequences, as the frontend tracks it."""

    def __init__(self, index: int, core_req_id: str, detokenizer: IncrementalDetokenizer,
                 want_logprobs: bool):
        self.index = index
        self.core_req_id = core_req_id
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[SampleLogprob] | None = [] if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # How much of the above the consumer has seen.
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.num_emitted_logprobs = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stop_reason = stop_reason


class _RequestState:
    def __init__(self, req_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float):
        self.req_id = req_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.sequences: list[_SequenceState] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[SampleLogprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.error: str | None = None
        self.engine_dead = False  # `error` is the dead engine's (not this request's own)
        self.changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)


class RequestStream:
    """The outputs of one request, as an async iterator (the last one has `finished`).

    Raises EngineRequestError if the engine fails the request (with `engine_dead` set
    when the engine died meanwhile). `aclose()`, or leaving `__anext__` by an exception
    or a cancellation, aborts the request if it is still unfinished.
    """

    def __init__(self, engine: AsyncEngine, state: _RequestState):
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
        output = self._engine._make_output(state)
        if output.finished:
            self._done = True
        return output

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
        self.token_text = TokenTextCache(tokenizer)
        self._requests: dict[str, _RequestState] = {}
        self._sequences: dict[str, tuple[_RequestState, _SequenceState]] = {}
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
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes; the last one has `finished`.

        `prompt` is text (tokenized here, with the tokenizer's special tokens) or token
        ids. Raises PromptError / SamplingParamsError before anything is queued,
        EngineRequestError if the engine fails the request, EngineDeadError if the
        engine is gone. Closing the iterator early aborts the request.
        """
        stream = await self.add_request(
            prompt, sampling_params, req_id, prompt_text=prompt_text, priority=priority,
            cache_salt=cache_salt, arrival_time=arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()  # the consumer left early (closed, cancelled, raised)

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
    ) -> RequestStream:
        """Queue a request now and return its stream (see `generate` for the errors).

        The caller owns the stream: it must iterate it to the end or `aclose()` it.
        """
        state = await self._add_request(prompt, sampling_params, req_id, prompt_text,
                                        priority, cache_salt, arrival_time)
        return RequestStream(self, state)

    async def abort(self, req_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort". Unknown ids: no-op."""
        self.abort_request(req_id)

    def abort_request(self, req_id: str) -> bool:
        """`abort` without awaiting: True if the request was unfinished."""
        state = self._requests.get(req_id)
        if state is None:
            return False
        self._abort_state(state)
        return True

    async def _add_request(self, prompt, params, req_id, prompt_text, priority, cache_salt,
                           arrival_time) -> _RequestState:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_text = prompt
            prompt_token_ids = list(self.tokenizer(prompt).input_ids)
        else:
            prompt_token_ids = [int(t) for t in prompt]
        check_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size)
        state = _RequestState(req_id, prompt_text, prompt_token_ids, params,
                              arrival_time if arrival_time is not None else time.time())
        core_requests = []
        for index in range(params.n):
            core_req_id = req_id if params.n == 1 else f"{req_id}-{index}"
            child_params = dataclasses.replace(params, n=1, seed=derive_seed(params.seed, index))
            detokenizer = IncrementalDetokenizer.from_params(
                self.tokenizer, prompt_token_ids, child_params)
            seq = _SequenceState(index, core_req_id, detokenizer, params.logprobs is not None)
            state.sequences.append(seq)
            core_requests.append(EngineCoreRequest(
                req_id=core_req_id,
                prompt_token_ids=prompt_token_ids,
                sampling_params=child_params,
                eos_token_id=self.eos_token_id,
                arrival_time=state.metrics.arrival_time,
                priority=priority,
                cache_salt=cache_salt,
            ))
        self._ensure_output_task()
        if not self._requests:
            self._busy_since = time.monotonic()
        self._requests[req_id] = state
        for seq in state.sequences:
            self._sequences[seq.core_req_id] = (state, seq)
            self._unscheduled.add(seq.core_req_id)
        try:
            for core_request in core_requests:
                await self.client.add_request_async(core_request)
        except BaseException:
            self._abort_state(state)
            raise
        return state

    def _abort_state(self, state: _RequestState) -> None:
        core_req_ids = []
        for seq in state.sequences:
            if not seq.finished:
                seq.finish("abort")
                core_req_ids.append(seq.core_req_id)
        self._forget(state)
        state.changed.set()
        if core_req_ids and self.dead_error is None:
            self._spawn(self.client.abort_requests_async(core_req_ids))

    def _forget(self, state: _RequestState) -> None:
        if self._requests.pop(state.req_id, None) is None:
            return
        for seq in state.sequences:
            self._sequences.pop(seq.core_req_id, None)
            self._unscheduled.discard(seq.core_req_id)
        state.metrics.finished_time = time.time()
        if self.observer is not None:
            try:
                self.observer.on_request_finished(self._snapshot(state), state.error)
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
        entry = self._sequences.get(core_output.req_id)
        if entry is None:
            return  # aborted meanwhile
        state, seq = entry
        if core_output.error is not None or core_output.finish_reason == "error":
            state.error = core_output.error or "the engine failed this request"
            seq.finish("error")
            self._abort_siblings(state, to_abort)
            self._forget(state)
            state.changed.set()
            return
        new_token_ids = core_output.new_token_ids
        if new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            seq.token_ids.extend(new_token_ids)
            if seq.logprobs is not None and core_output.new_logprobs is not None:
                seq.logprobs.extend(self._convert_logprobs(core_output.new_logprobs))
        if state.prompt_logprobs is not None and core_output.new_prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._convert_logprobs(core_output.new_prompt_logprobs))
        state.num_cached_tokens = max(state.num_cached_tokens, core_output.num_cached_tokens)
        # A stop token (EOS or a stop token id) ends the sequence: its text is hidden.
        stop_string = seq.detokenizer.update(
            new_token_ids, stop_token_terminated=core_output.stopped_by_token)
        if stop_string is not None:
            seq.finish("stop", stop_string)
            if not core_output.finished:
                to_abort.append(seq.core_req_id)
        elif core_output.finished:
            seq.finish(core_output.finish_reason, core_output.stop_reason)
        if seq.finished:
            self._sequences.pop(seq.core_req_id, None)
            if state.finished:
                self._forget(state)
        state.changed.set()

    def _abort_siblings(self, state: _RequestState, to_abort: list[str]) -> None:
        for seq in state.sequences:
            if not seq.finished:
                seq.finish("abort")
                to_abort.append(seq.core_req_id)

    def _convert_logprobs(self, rows: Logprobs) -> list[SampleLogprob]:
        token_text = self.token_text
        converted = []
        for token_ids, logprobs, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
            top = [TopLogprob(t, lp, token_text(t)) for t, lp in zip(token_ids[1:], logprobs[1:], strict=True)]
            converted.append(
                SampleLogprob(token_ids[0], logprobs[0], rank, token_text(token_ids[0]), top))
        return converted

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

    # ------------------------------------------------------------------ snapshots
    def _make_output(self, state: _RequestState) -> RequestOutput:
        """Everything new since the previous call, plus the cumulative state."""
        outputs = []
        for seq in state.sequences:
            text = seq.detokenizer.get_text(finished=seq.finished)
            delta_text = text[seq.num_emitted_chars:]
            seq.num_emitted_chars = len(text)
            delta_token_ids = seq.token_ids[seq.num_emitted_tokens:]
            seq.num_emitted_tokens = len(seq.token_ids)
            delta_logprobs = None
            if seq.logprobs is not None:
                delta_logprobs = seq.logprobs[seq.num_emitted_logprobs:]
                seq.num_emitted_logprobs = len(seq.logprobs)
            outputs.append(CompletionOutput(
                index=seq.index,
                text=text,
                delta_text=delta_text,
                token_ids=list(seq.token_ids),
                delta_token_ids=delta_token_ids,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                delta_logprobs=delta_logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            ))
        return RequestOutput(
            req_id=state.req_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=outputs,
            finished=state.finished,
            metrics=state.metrics.copy(),
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=state.prompt_logprobs,
        )

    def _snapshot(self, state: _RequestState) -> RequestOutput:
        """The cumulative state only (for observers); does not move the delta marks."""
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.get_text(finished=seq.finished),
                delta_text="",
                token_ids=list(seq.token_ids),
                delta_token_ids=[],
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in state.sequences
        ]
        return RequestOutput(
            req_id=state.req_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            outputs=outputs, finished=state.finished, metrics=dataclasses.replace(state.metrics),
            num_cached_tokens=state.num_cached_tokens,
        )

    # ------------------------------------------------------------------ control
    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility_async("reset_prefix_cache"))

    async def xray_snapshot(self, limits: XrayLimits) -> XraySnapshot:
        """The engine core's queues, block pool, prefix cache and recent steps (engine/core/xray.py)."""
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
