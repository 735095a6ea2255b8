"""What the sampler needs for one step's batch, gathered from `SamplingState`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step, in batch order (row b = logits row b).

    Every optional tensor is `None` when no row of the batch needs that stage, and
    the sampler then skips the stage entirely; the `no_*` properties name those
    fast paths. Rows that do not use a stage but sit in a batch where another row
    does carry neutral values (top_k = vocab size, top_p = inf, min_p = 0, ...),
    so a stage applied to them is an exact no-op.

    Greedy rows carry temperature 1 and neutral filters; their token is the argmax
    of the processed logits and they draw no noise.
    """

    num_reqs: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [B] bool, True for greedy rows; None when all_greedy or all_random.
    is_greedy: torch.Tensor | None = None
    # The same as increasing batch positions (numpy), when is_greedy is set.
    greedy_rows: np.ndarray | None = None
    # [B] float32, 1.0 on greedy rows; None when every random row has temperature 1.
    temperature: torch.Tensor | None = None
    # [B] long, vocab_size where disabled; None when no random row uses top-k.
    top_k: torch.Tensor | None = None
    max_top_k: int = 0  # largest enabled top_k in the batch (0 when top_k is None)
    # [B] float32, +inf where disabled; None when no random row uses top-p.
    top_p: torch.Tensor | None = None
    # Some row uses top-p without top-k (its nucleus is not bounded by a k).
    top_p_unbounded: bool = False
    # [B] float32, 0 where disabled; None when no random row uses min-p.
    min_p: torch.Tensor | None = None
    # Batch position -> the row's own generator, for random rows with a seed.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Penalties, only for the Bp rows that have one. None when no row has one.
    penalty_rows: torch.Tensor | None = None  # [Bp] long, batch positions
    # [Bp, V] int32, counts of output tokens (a verify row's include the drafts before it)
    output_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None  # [Bp, V] bool; None if no repetition penalty
    repetition_penalty: torch.Tensor | None = None  # [Bp] float32
    frequency_penalty: torch.Tensor | None = None  # [Bp] float32
    presence_penalty: torch.Tensor | None = None  # [Bp] float32
    # Logit bias as flat (batch position, token id, bias) triples.
    bias_rows: torch.Tensor | None = None
    bias_token_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # min_tokens: flat (batch position, token id) pairs to mask to -inf this step.
    min_tokens_rows: torch.Tensor | None = None
    min_tokens_token_ids: torch.Tensor | None = None
    # Structured outputs: next-token masks for the constrained rows only. Row
    # grammar_rows[i] keeps the tokens whose bits are set in grammar_bitmask[i]
    # (int32 [Bg, ceil(V / 32)]); None when no row is constrained.
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None
    # [B] requested top-N logprobs per row, -1 = no logprobs.
    num_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    max_num_logprobs: int | None = None  # None: no row wants logprobs

    def greedy_positions(self) -> np.ndarray:
        """Batch positions of the greedy rows, increasing."""
        if self.all_greedy:
            return np.arange(self.num_reqs)
        if self.all_random:
            return np.zeros(0, np.int64)
        if self.greedy_rows is None:
            self.greedy_rows = np.flatnonzero(self.is_greedy.cpu().numpy())
        return self.greedy_rows

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @property
    def no_penalties(self) -> bool:
        return self.penalty_rows is None

    @property
    def no_logit_bias(self) -> bool:
        return self.bias_rows is None

    @property
    def no_min_tokens(self) -> bool:
        return self.min_tokens_rows is None
