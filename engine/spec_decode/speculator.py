"""The scheduler's speculator: draft tokens per request, acceptance and back-off."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from engine.config import SpeculativeConfig
from engine.spec_decode.ngram import find_ngram_draft
from engine.spec_decode.suffix import SuffixIndex

# method draft_model: the scheduler's drafts are this many placeholders; the model runner
# replaces them with the draft model's tokens before the step's forward pass
# (engine/worker/draft_model.py), so budgets, slots and rollbacks work as for n-grams.
DRAFT_PLACEHOLDER = -1


class Request(Protocol):
    """What the speculator reads of engine.request.Request."""

    req_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: Any  # SamplingParams

    @property
    def num_output_tokens(self) -> int: ...


@dataclass
class SpecDecodingStats:
    """Drafts verified since the last `take_stats` (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # requests that carried draft tokens, counted per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_pos[i]: drafts whose token i was accepted (i < num_speculative_tokens).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Proposed draft tokens the request's grammar refused, cut before verification.
    num_grammar_cut_tokens: int = 0


class _RequestSpec:
    """One request's token copy (numpy, for the lookups) and acceptance counts."""

    __slots__ = ("tokens", "num_tokens", "eligible", "num_draft_tokens", "num_accepted_tokens",
                 "window_draft_tokens", "window_accepted_tokens", "paused_until", "num_pauses",
                 "draft_len")

    def __init__(self, eligible: bool, draft_len: int):
        self.tokens = np.zeros(256, dtype=np.int64)
        self.num_tokens = 0
        self.eligible = eligible
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.window_draft_tokens = 0  # since the last back-off decision
        self.window_accepted_tokens = 0
        self.paused_until = 0  # no drafts while the request has fewer tokens than this
        self.num_pauses = 0  # back-to-back windows below the acceptance rate
        self.draft_len = draft_len  # the longest draft its next step may carry

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Append the tokens added since the last call; the request's tokens as numpy."""
        num_tokens = len(token_ids)
        if num_tokens > len(self.tokens):
            grown = np.zeros(max(num_tokens, 2 * len(self.tokens)), dtype=np.int64)
            grown[:self.num_tokens] = self.tokens[:self.num_tokens]
            self.tokens = grown
        if num_tokens != self.num_tokens:
            start = min(self.num_tokens, num_tokens)
            self.tokens[start:num_tokens] = token_ids[start:]
            self.num_tokens = num_tokens
        return self.tokens[:num_tokens]


# A request whose drafts keep failing pauses for backoff_tokens x 2^n, n at most this.
MAX_BACKOFF_DOUBLINGS = 4


def may_speculate(params: Any, placeholders_only: bool = False) -> bool:
    """Whether a request's sampling allows drafts. Every rule takes part: penalties and
    min_tokens count each verified position's preceding drafts as outputs
    (SamplingState.make_metadata); the scheduler cuts a draft where the request's grammar
    refuses it and gives each verified position its own mask. Except grammars with
    `placeholders_only` (draft_model), whose tokens the scheduler never sees: they opt out."""
    return not (placeholders_only and params.structured_outputs is not None)


class Speculator:
    """Proposes draft tokens for decoding requests and learns from their acceptance.

    Contract with the scheduler:
      * `propose(request, max_drafts)` for a request whose next step is a single decode
        token; returns at most `max_drafts` token ids (often none), or for draft_model
        that many `DRAFT_PLACEHOLDER`s (the runner's draft model fills them in);
      * `record(req_id, num_drafts, num_accepted, num_tokens)` once per verified draft;
      * `finish(request)` when the request is freed (any reason).
    """

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self._states: dict[str, _RequestSpec] = {}
        self._stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.placeholders_only = config.method == "draft_model"
        self.suffix_index = (SuffixIndex(config.prompt_lookup_min, config.prompt_lookup_max,
                                         config.suffix_cache_max_requests)
                             if config.method == "suffix" else None)

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        state = self._states.get(request.req_id)
        if state is None:
            state = self._states[request.req_id] = _RequestSpec(
                may_speculate(request.sampling_params, self.placeholders_only),
                self.num_speculative_tokens)
        num_drafts = min(state.draft_len, max_drafts)
        token_ids = request.all_token_ids
        if not state.eligible or num_drafts <= 0 or len(token_ids) < state.paused_until:
            return []
        if self.placeholders_only:
            return [DRAFT_PLACEHOLDER] * num_drafts
        tokens = state.sync(token_ids)
        config = self.config
        draft = find_ngram_draft(tokens, config.prompt_lookup_min, config.prompt_lookup_max,
                                 num_drafts)
        if self.suffix_index is not None and len(draft) < num_drafts:
            other = self.suffix_index.propose(tokens, num_drafts)
            if len(other) > len(draft):
                draft = other
        return draft.tolist()

    def may_propose(self, request: Request) -> bool:
        """Whether `propose` could return drafts for `request` at its next decode step
        (it is eligible and not paused; the lookup itself may still find nothing)."""
        state = self._states.get(request.req_id)
        if state is None:
            return may_speculate(request.sampling_params, self.placeholders_only)
        return state.eligible and len(request.all_token_ids) >= state.paused_until

    def record(self, req_id: str, num_drafts: int, num_accepted: int, num_tokens: int) -> None:
        """A draft of `num_drafts` tokens was verified; `num_accepted` of them matched.
        `num_tokens`: the request's tokens now (for the back-off pause)."""
        stats = self._stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        per_pos = stats.num_accepted_tokens_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1
        state = self._states.get(req_id)
        if state is None:
            return
        state.num_draft_tokens += num_drafts
        state.num_accepted_tokens += num_accepted
        state.window_draft_tokens += num_drafts
        state.window_accepted_tokens += num_accepted
        config = self.config
        if config.adaptive_draft_length:
            # All accepted: twice as long next time (up to k); a rejection at position a:
            # a + 1 (the next draft is as long as this one's right part, plus one).
            # Worked example, k 8: drafts of 8 -> rejected at 2 -> 3 -> all accepted -> 6
            # -> all accepted -> 8.
            state.draft_len = (min(self.num_speculative_tokens, 2 * state.draft_len)
                               if num_accepted == num_drafts else num_accepted + 1)
        if state.window_draft_tokens >= config.backoff_min_draft_tokens:
            rate = state.window_accepted_tokens / state.window_draft_tokens
            if rate < config.min_acceptance_rate:
                # Each window in a row that fails again doubles the pause (up to 16x):
                # backoff_tokens 64 -> pauses of 64, 128, 256, ... 1024 tokens.
                state.paused_until = num_tokens + config.backoff_tokens * (
                    1 << min(state.num_pauses, MAX_BACKOFF_DOUBLINGS))
                state.num_pauses += 1
            else:
                state.num_pauses = 0
            state.window_draft_tokens = state.window_accepted_tokens = 0

    def finish(self, request: Request) -> None:
        self._states.pop(request.req_id, None)
        if self.suffix_index is not None and request.num_output_tokens > 0:
            self.suffix_index.add(np.asarray(request.all_token_ids, dtype=np.int64))

    def acceptance(self, req_id: str) -> tuple[int, int]:
        """(draft tokens proposed, accepted) for a live request; (0, 0) if none."""
        state = self._states.get(req_id)
        return (state.num_draft_tokens, state.num_accepted_tokens) if state else (0, 0)

    def record_grammar_cut(self, num_cut: int) -> None:
        """The scheduler cut `num_cut` tokens off a proposed draft: the request's grammar
        refuses the first of them (structured outputs)."""
        self._stats.num_grammar_cut_tokens += num_cut

    def take_stats(self) -> SpecDecodingStats:
        stats = self._stats
        self._stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * self.num_speculative_tokens)
        return stats
