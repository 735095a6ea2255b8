"""Logprobs of chosen tokens plus the top-N alternatives, as tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import Logprobs


@dataclass
class LogprobsTensors:
    """One row per token: column 0 is the chosen token, columns 1..N the top-N.

    token_ids: [R, 1+N] long; logprobs: [R, 1+N] float32, aligned with token_ids;
    ranks: [R] long, rank of the chosen token (1 = best; ties share the best rank).
    Top-N columns are in descending logprob order.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to_logprobs(self, num_top: int | None = None) -> Logprobs:
        """All rows as one `Logprobs`, keeping the first `num_top` alternatives."""
        end = None if num_top is None else 1 + num_top
        return Logprobs(
            token_ids=self.token_ids[:, :end].tolist(),
            logprobs=self.logprobs[:, :end].tolist(),
            ranks=self.ranks.tolist(),
        )

    def split(self, num_logprobs: Sequence[int]) -> list[Logprobs | None]:
        """One single-token `Logprobs` per row with `num_logprobs[i]` alternatives;
        None for rows whose count is negative (no logprobs requested)."""
        token_ids, logprobs, ranks = (
            self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        )
        out: list[Logprobs | None] = []
        for i, n in enumerate(num_logprobs):
            n = int(n)
            if n < 0:
                out.append(None)
            else:
                out.append(Logprobs([token_ids[i][: 1 + n]], [logprobs[i][: 1 + n]], [ranks[i]]))
        return out


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Pick `token_ids[r]` and the `num_top` best entries of each row of `logprobs` [R, V]."""
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.long).view(-1, 1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(-1) + 1
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        chosen = torch.cat([chosen, top_values], dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=chosen, ranks=ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """Logprobs of prompt tokens: `logits[p]` [P, V] predicts `target_ids[p]` [P].

    Uses the raw model logits (no sampling parameter applies to the prompt), in
    float32. The caller bounds P (the step's chunk) since this makes a [P, V] copy.
    """
    if num_top < 0:
        raise ValueError("num_top must be >= 0")
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    return gather_logprobs(logprobs, target_ids, min(num_top, logprobs.shape[-1]))
