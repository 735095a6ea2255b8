"""Verification of draft tokens (speculative decoding): one more per-row sampler rule.

A request verifying k draft tokens d_0..d_{k-1} has k + 1 logits rows: row i is the
model's next-token distribution p_i after the request's tokens and d_0..d_{i-1}. It
emits d_0..d_{a-1} and one more token t_a, where a is the number of accepted drafts:

  * greedy rows: d_i is accepted when it is the argmax of row i; t_a is row a's argmax,
    so the output is exactly what one-token-at-a-time greedy decoding would give;
  * random rows (rejection sampling, Leviathan et al. 2023): the proposers here are
    deterministic, i.e. the draft distribution q_i is one-hot on d_i. d_i is accepted
    with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i); the first rejected
    position samples from the residual max(0, p_i - q_i), normalised = p_i with d_i
    removed and renormalised; if all k are accepted, t_k is sampled from p_k. Every
    emitted token is then distributed exactly as p (P(d_i) = p_i(d_i); any other x:
    (1 - p_i(d_i)) * p_i(x) / (1 - p_i(d_i)) = p_i(x)).

p_i is the distribution the ordinary sampler draws from (temperature, top-k/p, min-p,
logit bias, and over the history min_tokens and the penalties, for which row i's outputs
include d_0..d_{i-1}: SamplingState.make_metadata), processed by the same functions.

    rows of one step (2 requests, drafts [7, 9] and none):
      row:     0      1      2      3
      draft:   7      9     -1     -1      (-1: the request's last row, no draft)
      segment: [-- request 0 --]  [r1]
      accept:  yes    no     -             -> request 0 emits [7, t_1], request 1 [t_0]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.sample.logprobs import LogprobsTensors, gather_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import greedy_argmax, process_logits, random_probs


@dataclass
class VerifiedTokens:
    """emitted_token_ids [R]: row i's emitted token (rows past a request's last emitted
    token carry junk); num_accepted [B]: accepted drafts per request; logprobs: of the
    emitted tokens, one row per logits row (None unless some row asked)."""

    emitted_token_ids: np.ndarray
    num_accepted: np.ndarray
    logprobs: LogprobsTensors | None = None


def acceptance_probability(draft_probs: torch.Tensor) -> torch.Tensor:
    """P(accept d_i) given p_i(d_i), for a one-hot draft distribution."""
    return draft_probs


def residual_probs(probs: torch.Tensor, draft_token_ids: torch.Tensor,
                   has_draft: torch.Tensor) -> torch.Tensor:
    """max(0, p - q) with q one-hot on the draft (rows with a draft), unnormalised:
    the draft token's probability becomes 0 (in place)."""
    rows = has_draft.nonzero().squeeze(1)
    probs[rows, draft_token_ids[rows]] = 0.0
    return probs


class DraftVerifier:
    """Verifies one step's drafts. `generator`: the RNG of unseeded rows (None: global),
    the ordinary sampler's; a seeded row draws from its own generator."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata,
                 draft_token_ids: np.ndarray, num_rows: np.ndarray) -> VerifiedTokens:
        """`logits` [R, V] and `md` (R rows) in request order; `draft_token_ids` [R] the
        draft each row checks (-1 on each request's last row); `num_rows` [B] rows per
        request (its drafts + 1). A float32 `logits` may be modified."""
        logits = process_logits(logits, md)
        logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.all_greedy:
            emitted = greedy_argmax(logits)
            emitted = emitted.numpy() if emitted.is_cpu else emitted.cpu().numpy()
            # A row's draft is accepted when it is the argmax; no draft (-1) never is.
            rejected = np.flatnonzero(emitted != draft_token_ids)
        else:
            emitted, accepted = self._verify_random(logits, md, draft_token_ids,
                                                    draft_token_ids >= 0)
            rejected = np.flatnonzero(~accepted)
        # Worked example: num_rows [3, 1], drafts [7, 9, -1, -1], accepted [T, F, F, F]
        # (a request's last row has no draft, so every request has a rejected row):
        #   starts = [0, 3]; rejected rows = [1, 2, 3]
        #   first rejected row at or after each start = [1, 3] -> num_accepted = [1, 0];
        #   rows before their request's first rejection emit their draft: row 0 -> 7.
        starts = np.cumsum(num_rows) - num_rows
        first_stop = rejected[np.searchsorted(rejected, starts)]
        num_accepted = first_stop - starts
        if not md.all_greedy:  # an accepted greedy row's argmax already is its draft
            keep_draft = np.arange(len(draft_token_ids)) < np.repeat(first_stop, num_rows)
            emitted = np.where(keep_draft, draft_token_ids, emitted)
        lp = None
        if logprobs is not None:
            lp = gather_logprobs(logprobs, torch.from_numpy(emitted),
                                 min(md.max_num_logprobs, logits.shape[-1]))
        return VerifiedTokens(emitted, num_accepted, lp)

    def _verify_random(self, logits: torch.Tensor, md: SamplingMetadata,
                       draft_token_ids: np.ndarray,
                       has_draft: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Emitted tokens (the residual sample of every row) and acceptance, all rows."""
        greedy_rows = None if md.all_random else md.greedy_positions()
        greedy = None if greedy_rows is None else greedy_argmax(logits, greedy_rows)
        probs = random_probs(logits, md)  # divides `logits` in place
        probs.div_(probs.sum(dim=-1, keepdim=True))
        device = probs.device
        drafts = torch.from_numpy(np.maximum(draft_token_ids, 0)).to(device)
        has_draft_t = torch.from_numpy(has_draft).to(device)
        draft_probs = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        uniform = torch.rand(len(draft_token_ids), generator=self.generator, device=device)
        noise = torch.empty_like(probs)
        if len(md.generators) < md.num_reqs:
            noise.uniform_(generator=self.generator)
        for pos, generator in md.generators.items():
            # A seeded row without a draft draws just its V uniforms, as in the sampler.
            if has_draft[pos]:
                uniform[pos] = torch.rand(1, generator=generator, device=device)[0]
            noise[pos].uniform_(generator=generator)
        accepted = (has_draft_t & (uniform < acceptance_probability(draft_probs))).cpu().numpy()
        residual = residual_probs(probs, drafts, has_draft_t)
        # The exponential race (as in Sampler._race): argmin p / log U picks x w.p. p(x).
        emitted = residual.div_(noise.log_()).argmin(dim=-1).cpu().numpy()
        if greedy is not None:
            greedy_np = greedy.cpu().numpy()
            emitted[greedy_rows] = greedy_np
            accepted[greedy_rows] = has_draft[greedy_rows] & (
                greedy_np == draft_token_ids[greedy_rows])
        return emitted, accepted
