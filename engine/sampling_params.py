"""Per-request sampling parameters: what to sample and when to stop."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured_output.params import StructuredOutputsParams

# Hard caps a client cannot exceed (an operator may lower them at the server edge).
MAX_LOGPROBS = 20
_GREEDY_EPS = 1e-5


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """What the sampler does for one request, and when the request stops.

    `temperature == 0` means greedy. `max_tokens=None` means "the rest of the
    context" and is resolved by the engine against `max_model_len`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs besides the sampled token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # The output must match this grammar (engine/structured_output/); None: free text.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(message, param)

        check(self.n >= 1, "n", f"n must be at least 1, got {self.n}.")
        check(self.temperature >= 0.0, "temperature",
              f"temperature must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        check(self.repetition_penalty > 0.0, "repetition_penalty",
              f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}.")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
              "min_tokens cannot be combined with structured outputs (a complete output "
              "may allow nothing but its end).")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                  f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}.")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                check(-100.0 <= bias <= 100.0, "logit_bias",
                      f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS
