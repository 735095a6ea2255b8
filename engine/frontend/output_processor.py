"""OutputProcessor: engine-core outputs in, detokenized `RequestOutput`s out.

    EngineCoreOutput (new token ids, logprobs, finish) ──▶ its sequence's state
        detokenize (UTF-8 safe), match stop strings ──▶ finish "stop" (abort it in the core)
        convert logprobs rows to SampleLogprobs (with each token's text)
    make_output(state) ──▶ RequestOutput: every sequence, cumulative + delta since last call

Shared by the server's AsyncEngine (which adds streams, health and metrics around it)
and the offline LLM API (which drives the core itself and keeps the final outputs).
A request with n sequences is one `RequestState`; its core requests are looked up by
their own ids ("{req_id}-{i}", see engine/frontend/processor.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from engine.frontend.detokenizer import IncrementalDetokenizer, TokenTextCache
from engine.frontend.processor import ProcessedRequest
from engine.outputs import EngineCoreOutput, Logprobs
from engine.request_output import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    SampleLogprob,
    SampleLogprobs,
    TopLogprob,
)


class SequenceState:
    """One of a request's n sequences, as the front end tracks it."""

    def __init__(self, index: int, core_req_id: str, detokenizer: IncrementalDetokenizer,
                 want_logprobs: bool):
        self.index = index
        self.core_req_id = core_req_id
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = SampleLogprobs() if want_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # How much of the above the consumer has seen (make_output's deltas).
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


class RequestState:
    """A request and its sequences. `changed` is set whenever an output changed it (the
    AsyncEngine's stream waits on it; the offline API never looks)."""

    def __init__(self, processed: ProcessedRequest, sequences: list[SequenceState]):
        self.req_id = processed.req_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.params = processed.params
        self.sequences = sequences
        self.metrics = RequestMetrics(arrival_time=processed.arrival_time)
        self.num_cached_tokens = 0
        lora = processed.core_requests[0].lora_request if processed.core_requests else None
        self.lora_name = lora.name if lora is not None else None
        self.prompt_logprobs: list[SampleLogprob | None] | None = (
            [None] if processed.params.prompt_logprobs is not None else None
        )
        self.error: str | None = None
        self.pooled: list[float] | None = None  # a pooling request's vector
        self.engine_dead = False  # `error` is the dead engine's (not this request's own)
        self.changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)


class OutputProcessor:
    """The unfinished requests of one front end, by request id and by core request id."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.token_text = TokenTextCache(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.sequences: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(self, processed: ProcessedRequest) -> RequestState:
        """Track a processed request: one detokenizer per sequence, with its own params."""
        want_logprobs = processed.params.logprobs is not None
        sequences = [
            SequenceState(index, core_request.req_id,
                          IncrementalDetokenizer.from_params(
                              self.tokenizer, processed.prompt_token_ids,
                              core_request.sampling_params),
                          want_logprobs)
            for index, core_request in enumerate(processed.core_requests)
        ]
        state = RequestState(processed, sequences)
        self.requests[state.req_id] = state
        for seq in sequences:
            self.sequences[seq.core_req_id] = (state, seq)
        return state

    def remove_request(self, state: RequestState) -> bool:
        """Stop tracking a request; False if it was not tracked (any more)."""
        if self.requests.pop(state.req_id, None) is None:
            return False
        for seq in state.sequences:
            self.sequences.pop(seq.core_req_id, None)
        return True

    def process_output(self, core_output: EngineCoreOutput, now: float,
                       to_abort: list[str]) -> RequestState | None:
        """Apply one core output; returns its request's state (None if no longer tracked).

        Core request ids to abort in the core (a stop string matched before the core
        finished the sequence; the siblings of a failed sequence) go to `to_abort`. A
        failed sequence sets `state.error` and finishes its request. The request stays
        tracked until the caller removes it (when `state.finished`).
        """
        entry = self.sequences.get(core_output.req_id)
        if entry is None:
            return None  # aborted meanwhile
        state, seq = entry
        if core_output.error is not None or core_output.finish_reason == "error":
            state.error = core_output.error or "the engine failed this request"
            seq.finish("error")
            for sibling in state.sequences:
                if not sibling.finished:
                    sibling.finish("abort")
                    to_abort.append(sibling.core_req_id)
            return state
        new_token_ids = core_output.new_token_ids
        # A stop token (EOS or a stop token id) ends the sequence: its text is hidden.
        stop_string = seq.detokenizer.update(
            new_token_ids, stop_token_terminated=core_output.stopped_by_token)
        if new_token_ids:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            # Several tokens at once (speculative decoding): none after a stop string.
            num_kept = seq.detokenizer.num_tokens_kept
            cut = num_kept < len(new_token_ids)
            seq.token_ids.extend(new_token_ids[:num_kept] if cut else new_token_ids)
            if seq.logprobs is not None and core_output.new_logprobs is not None:
                converted = self.convert_logprobs(core_output.new_logprobs)
                seq.logprobs.extend(converted[:num_kept] if cut else converted)
        if state.prompt_logprobs is not None and core_output.new_prompt_logprobs is not None:
            state.prompt_logprobs.extend(self.convert_logprobs(core_output.new_prompt_logprobs))
        state.num_cached_tokens = max(state.num_cached_tokens, core_output.num_cached_tokens)
        if core_output.pooled is not None:
            state.pooled = core_output.pooled
        if stop_string is not None:
            seq.finish("stop", stop_string)
            if not core_output.finished:
                to_abort.append(seq.core_req_id)
        elif core_output.finished:
            seq.finish(core_output.finish_reason, core_output.stop_reason)
        if seq.finished:
            self.sequences.pop(seq.core_req_id, None)
        return state

    def convert_logprobs(self, rows: Logprobs) -> list[SampleLogprob]:
        token_text = self.token_text
        converted = []
        for token_ids, logprobs, rank in zip(rows.token_ids, rows.logprobs, rows.ranks,
                                             strict=True):
            top = [TopLogprob(t, lp, token_text(t))
                   for t, lp in zip(token_ids[1:], logprobs[1:], strict=True)]
            converted.append(
                SampleLogprob(token_ids[0], logprobs[0], rank, token_text(token_ids[0]), top))
        return converted

    # ------------------------------------------------------------------ outputs
    @staticmethod
    def make_output(state: RequestState) -> RequestOutput:
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
                delta_logprobs = SampleLogprobs(seq.logprobs[seq.num_emitted_logprobs:])
                seq.num_emitted_logprobs = len(seq.logprobs)
            outputs.append(CompletionOutput(
                index=seq.index,
                text=text,
                delta_text=delta_text,
                token_ids=list(seq.token_ids),
                delta_token_ids=delta_token_ids,
                logprobs=SampleLogprobs(seq.logprobs) if seq.logprobs is not None else None,
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
            pooled=state.pooled,
            lora_name=state.lora_name,
        )

    @staticmethod
    def snapshot(state: RequestState) -> RequestOutput:
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
            num_cached_tokens=state.num_cached_tokens, lora_name=state.lora_name,
        )
