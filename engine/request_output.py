"""What the front end hands its callers (AsyncEngine, LLM): detokenized, per-request outputs.

A `RequestOutput` always lists every one of the request's `n` sequences, each as a
`CompletionOutput` carrying both the cumulative state and the delta since the
previous `RequestOutput` of the same request. Text deltas concatenate exactly to the
final text; a delta may be empty while tokens arrive (text is held back while it
could still be part of a stop string or of a multi-byte character).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TopLogprob:
    token_id: int
    logprob: float
    token: str  # the token's own decoded text


@dataclass
class SampleLogprob:
    """Logprob of one position: the chosen token, its rank, and the top-N alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    token: str
    top: list[TopLogprob] = field(default_factory=list)


class SampleLogprobs(list[SampleLogprob]):
    """A sequence's logprobs, one `SampleLogprob` per position; also readable by column
    (`token_ids[i]` = the chosen id then the top ids of position i, as the engine core's
    `Logprobs` rows are), for callers that compare numbers rather than tokens."""

    @property
    def token_ids(self) -> list[list[int]]:
        return [[entry.token_id] + [top.token_id for top in entry.top] for entry in self]

    @property
    def logprobs(self) -> list[list[float]]:
        return [[entry.logprob] + [top.logprob for top in entry.top] for entry in self]

    @property
    def ranks(self) -> list[int]:
        return [entry.rank for entry in self]


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything visible so far
    delta_text: str  # new since the previous RequestOutput
    token_ids: list[int]
    delta_token_ids: list[int]
    logprobs: SampleLogprobs | None = None  # None unless logprobs were requested
    delta_logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of one request; None until they happen."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def copy(self) -> RequestMetrics:
        return RequestMetrics(self.arrival_time, self.first_scheduled_time,
                              self.first_token_time, self.last_token_time, self.finished_time)


@dataclass
class RequestOutput:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # One entry per prompt token (the first is None); None unless prompt_logprobs was set.
    prompt_logprobs: list[SampleLogprob | None] | None = None
    # A pooling request's vector (engine.pooling_params), once finished; else None.
    pooled: list[float] | None = None
    lora_name: str | None = None  # the LoRA adapter it ran under (None: the base)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generation_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs)
