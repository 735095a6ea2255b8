"""The sampler: one step's logits [B, V] + SamplingMetadata -> one token per row.

Processing order (each stage is skipped when no row of the batch needs it):

  1. logits in float32 (a float32 input is modified in place);
  2. logit_bias is added; constrained rows (structured outputs) get their grammar's
     token bitmask: forbidden tokens -> -inf (only those rows pay for it);
  3. min_tokens: while a row has fewer than `min_tokens` outputs, its EOS and
     `stop_token_ids` are set to -inf (whatever `ignore_eos` says: that flag
     only affects stopping);
  4. penalties, over the row's history: repetition (tokens seen in prompt or
     output: positive logits divided by it, negative ones multiplied), then
     frequency (minus penalty x output count) and presence (minus penalty x
     [output count > 0]); the last two count output tokens only, as OpenAI does;
  5. logprobs are log_softmax of these processed, *untempered* logits: the
     sampled token's value and rank and the top-N (N = the batch's largest
     request; the caller trims per row);
  6. greedy rows: argmax of the processed logits (`greedy_argmax`: one read of each
     greedy row and of no other; numpy's SIMD argmax on the CPU);
  7. random rows: divide by temperature, then top-k, top-p (on the top-k
     renormalised distribution; keeps the smallest set of best tokens whose mass
     reaches top_p, always at least one), min-p (drop tokens whose probability
     is below min_p x the best one's), then sample.

Filtering works on the softmax of the tempered logits, as one per-row
probability cutoff (a token stays when its probability is >= the cutoff; the
rest get probability 0, without renormalising: the race does not need it).
Top-k / top-p look at each row's best C tokens (a topk, not a full-vocab sort;
C = largest top_k + 1, at least 1024 if some top-p row has no top-k); top-p
falls back to a full sort only for rows whose nucleus is longer than that.

Sampling is an exponential race: token = argmax_i p_i / E_i with E_i ~ Exp(1)
i.i.d., which picks i with probability p_i; with E = -log U it is
argmin_i p_i / log U_i. Unseeded rows share one batched uniform draw (from
`Sampler.generator`, default the global RNG); a seeded row draws its own V
uniforms from its own generator per sampled token, so its tokens depend only on
its seed and logits, never on the batch. When every random row's kept tokens lie
among its C candidates, the race runs over [B, C] instead of [B, V] (seeded rows
still draw V uniforms and use their candidates' entries: the same token as the
full race). Checking that, and the top-p fallback, cost one device sync each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.sample.logprobs import LogprobsTensors, gather_logprobs
from engine.sample.metadata import SamplingMetadata
from engine.structured_output.backend import apply_bitmask

# Candidates examined by top-p before falling back to a full sort of the row.
_NUM_CANDIDATES = 1024


@dataclass
class SamplerOutput:
    """sampled_token_ids: [B] long. logprobs: None unless a row asked for them; then
    [B, 1 + max_num_logprobs] for every row (rows that asked for fewer are trimmed
    by the caller; rows that asked for none carry values anyway)."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None = None


class Sampler:
    """Stateless apart from `generator`, the RNG of unseeded rows (None: global)."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V]; a float32 input may be modified."""
        md = metadata
        logits = process_logits(logits, md)
        logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        if md.all_greedy:
            sampled = greedy_argmax(logits)
        else:
            # Greedy rows first (the random path below divides the logits in place);
            # only the greedy rows are read.
            greedy_rows = None if md.all_random else md.greedy_positions()
            greedy = None if greedy_rows is None else greedy_argmax(logits, greedy_rows)
            sampled = self._sample_random(logits, md)
            if greedy is not None:
                sampled[torch.from_numpy(greedy_rows).to(sampled.device)] = greedy
        lp = None
        if logprobs is not None:
            lp = gather_logprobs(logprobs, sampled, min(md.max_num_logprobs, logits.shape[-1]))
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    def probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution each row samples from [B, V] (one-hot on greedy rows).

        For tests and debugging; `logits` is not modified.
        """
        md = metadata
        logits = process_logits(logits.to(torch.float32, copy=True), md)
        greedy = F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float32)
        if md.all_greedy:
            return greedy
        probs = random_probs(logits, md)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        if md.all_random:
            return probs
        return torch.where(md.is_greedy.unsqueeze(1), greedy, probs)

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = tempered_probs(logits, md)
        filtered = filter_probs(probs, md)
        if filtered is None:
            return self._race(probs, md)
        if filtered.candidate_ids is not None:
            # Every row's kept tokens are among its candidates: race over those only.
            contained = filtered.contained if md.all_random else filtered.contained | md.is_greedy
            if bool(contained.all()):
                return self._candidate_race(filtered, md)
        probs.masked_fill_(probs < filtered.cutoff.unsqueeze(1), 0.0)
        return self._race(probs, md)

    def _race(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """argmin_i p_i / log U_i over the whole vocab (= argmax p_i / E_i)."""
        noise = torch.empty_like(probs)
        if len(md.generators) < md.num_reqs:
            noise.uniform_(generator=self.generator)
        for pos, generator in md.generators.items():
            noise[pos].uniform_(generator=generator)
        # U in [0, 1) -> log U in [-inf, 0): p / log U = -p / E; p = 0 never wins.
        noise.log_()
        return probs.div_(noise).argmin(dim=-1)

    def _candidate_race(self, filtered: _Filtered, md: SamplingMetadata) -> torch.Tensor:
        """The same race restricted to each row's candidates [B, C].

        Unseeded rows draw C uniforms. A seeded row still draws all V uniforms from
        its generator and uses those of its candidate tokens, so it picks exactly
        the token the full-vocab race would (and its stream advances the same).
        """
        values, ids = filtered.candidate_probs, filtered.candidate_ids
        probs = values.masked_fill(values < filtered.cutoff.unsqueeze(1), 0.0)
        noise = torch.empty_like(probs)
        if len(md.generators) < md.num_reqs:
            noise.uniform_(generator=self.generator)
        if md.generators:
            full = torch.empty(md.vocab_size, dtype=probs.dtype, device=probs.device)
            for pos, generator in md.generators.items():
                full.uniform_(generator=generator)
                noise[pos] = full[ids[pos]]
        noise.log_()
        best = probs.div_(noise).argmin(dim=-1, keepdim=True)
        return ids.gather(1, best).squeeze(1)


def greedy_argmax(logits: torch.Tensor, rows: np.ndarray | None = None) -> torch.Tensor:
    """argmax over the vocab of every row of `logits` [B, V] (or of `rows` only, an
    increasing array of row indices): [B] (or [len(rows)]) long. Ties go to the lowest
    index and NaN counts as the largest value, as in torch.argmax.

    Each row is read once. On the CPU this is numpy's argmax (SIMD; at [256, 49152]
    float32 it runs at memory speed, ~3x torch's one-thread argmax on this project's
    AVX2 machine); `rows` are taken as runs of consecutive rows (views, no copy).
    """
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        if rows is None:
            return logits.argmax(dim=-1)
        return logits[torch.from_numpy(rows).to(logits.device)].argmax(dim=-1)
    array = (logits.detach() if logits.requires_grad else logits).numpy()
    if rows is None:
        return torch.from_numpy(array.argmax(axis=-1).astype(np.int64, copy=False))
    if len(rows) == 0:
        return torch.zeros(0, dtype=torch.long)
    # Worked example: rows [0, 1, 2, 5, 7, 8] -> runs [0, 3), [5, 6), [7, 9):
    #   run_starts = positions where rows[i] != rows[i-1] + 1 = [0, 3, 4]
    run_starts = np.flatnonzero(np.diff(rows, prepend=-2) != 1)
    run_ends = np.append(run_starts[1:], len(rows))
    parts = [array[rows[s]:rows[e - 1] + 1].argmax(axis=-1)
             for s, e in zip(run_starts.tolist(), run_ends.tolist(), strict=True)]
    return torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False))


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Stages 1-4: float32, logit bias and grammar masks, min_tokens masking, penalties
    (in place)."""
    if logits.dim() != 2 or logits.shape[0] != md.num_reqs:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {md.num_reqs} rows")
    if logits.shape[1] != md.vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns, vocab is {md.vocab_size}")
    if logits.dtype != torch.float32:
        logits = logits.float()
    if md.bias_rows is not None:
        logits.index_put_((md.bias_rows, md.bias_token_ids), md.bias_values, accumulate=True)
    if md.grammar_bitmask is not None:
        apply_bitmask(logits, md.grammar_bitmask, md.grammar_rows)
    if md.min_tokens_rows is not None:
        logits.index_put_(
            (md.min_tokens_rows, md.min_tokens_token_ids), logits.new_tensor(float("-inf"))
        )
    if md.penalty_rows is not None:
        apply_penalties(logits, md)
    return logits


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
    """Repetition, frequency and presence penalties on the rows that have them."""
    rows = md.penalty_rows
    x = logits[rows]
    counts = md.output_counts
    output_seen = counts > 0
    if md.prompt_mask is not None:
        seen = md.prompt_mask | output_seen
        penalty = md.repetition_penalty.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    x -= md.frequency_penalty.unsqueeze(1) * counts
    x -= md.presence_penalty.unsqueeze(1) * output_seen
    logits[rows] = x


@dataclass
class _Filtered:
    """Outcome of the filters for a batch.

    cutoff [B]: a token stays when its probability is >= cutoff (0: no filter).
    candidate_probs / candidate_ids [B, C]: each row's C most likely tokens, in
    descending order (None when no top-k / top-p ran); contained [B]: whether the
    row's kept tokens all lie among its candidates.
    """

    cutoff: torch.Tensor
    candidate_probs: torch.Tensor | None = None
    candidate_ids: torch.Tensor | None = None
    contained: torch.Tensor | None = None


def tempered_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Softmax of logits / temperature (the division is done in place)."""
    if md.temperature is not None:
        logits.div_(md.temperature.unsqueeze(1))
    return logits.softmax(dim=-1)


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Stage 7 up to sampling, over the full vocab: [B, V] probabilities with
    filtered tokens set to 0, *not* renormalised (the race does not need it)."""
    probs = tempered_probs(logits, md)
    filtered = filter_probs(probs, md)
    if filtered is not None:
        probs.masked_fill_(probs < filtered.cutoff.unsqueeze(1), 0.0)
    return probs


def filter_probs(probs: torch.Tensor, md: SamplingMetadata) -> _Filtered | None:
    """Top-k, then top-p, then min-p on a softmax `probs` [B, V]; None: no filter.

    `md.top_k` holds V where disabled, `md.top_p` +inf, `md.min_p` 0.
    """
    vocab = probs.shape[-1]
    top_k, top_p, min_p = md.top_k, md.top_p, md.min_p
    result = None
    if top_p is not None:
        result = _top_k_top_p(probs, top_k, md.max_top_k, top_p, md.top_p_unbounded)
    elif top_k is not None:
        # One spare candidate, so a row's k-th token differs from the last candidate.
        num_cand = min(md.max_top_k + 1, vocab)
        values, ids = probs.topk(num_cand, dim=-1)
        cutoff = values.gather(1, (top_k.clamp(max=num_cand) - 1).unsqueeze(1)).squeeze(1)
        result = _Filtered(cutoff.masked_fill(top_k >= vocab, 0.0), values, ids)
    if min_p is not None:
        # p_i < min_p * p_max; the best token always stays.
        min_cutoff = probs.amax(dim=-1) * min_p
        if result is None:
            result = _Filtered(min_cutoff)
        else:
            result.cutoff = torch.maximum(result.cutoff, min_cutoff)
    if result is not None and result.candidate_probs is not None:
        values = result.candidate_probs
        if values.shape[1] == vocab:
            result.contained = torch.ones_like(result.cutoff, dtype=torch.bool)
        else:
            # All tokens past the candidates are <= the last one, hence dropped.
            result.contained = result.cutoff > values[:, -1]
    return result


def _top_k_top_p(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor,
    unbounded: bool = True,
) -> _Filtered:
    """Cutoff of top-k followed by top-p, from the best C tokens of each row.

    C = max_top_k + 1 when every top-p row also has a top-k (`unbounded` False),
    else at least `_NUM_CANDIDATES`.

    With p_i in descending order and Z the kept mass (the first k under top-k,
    else 1), token i stays when the mass strictly above it, sum_{j<i} p_j, is
    below top_p * Z; so the first token always stays. A row whose C candidates
    are all kept (and no top-k bounds it) gets its cutoff from a full sort.
    """
    num_reqs, vocab = probs.shape
    num_cand = min(vocab, max(_NUM_CANDIDATES if unbounded else 1, max_top_k + 1))
    values, ids = probs.topk(num_cand, dim=-1)
    cum = values.cumsum(dim=-1)
    above = F.pad(cum[:, :-1], (1, 0))
    if top_k is not None:
        has_k = top_k < vocab
        k = top_k.clamp(max=num_cand)
        kept_mass = cum.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        mass = torch.where(has_k, kept_mass, torch.ones_like(kept_mass))
    else:
        has_k = torch.zeros(num_reqs, dtype=torch.bool, device=probs.device)
        k = None
        mass = torch.ones(num_reqs, dtype=probs.dtype, device=probs.device)
    threshold = (top_p * mass).unsqueeze(1)
    # At least one token survives, even when top_p * mass underflows to 0.
    count = (above < threshold).sum(dim=-1).clamp(min=1)
    if k is not None:
        count = torch.minimum(count, k)
    cutoff = values.gather(1, (count - 1).unsqueeze(1)).squeeze(1)
    p_on = torch.isfinite(top_p)
    cutoff = cutoff.masked_fill(~p_on & ~has_k, 0.0)
    if num_cand < vocab:
        redo = (p_on & ~has_k & (count >= num_cand)).nonzero().squeeze(1)
        if redo.numel():
            full = probs[redo].sort(dim=-1, descending=True).values
            full_above = F.pad(full.cumsum(dim=-1)[:, :-1], (1, 0))
            full_count = (full_above < threshold[redo]).sum(dim=-1).clamp(min=1)
            cutoff[redo] = full.gather(1, (full_count - 1).unsqueeze(1)).squeeze(1)
    return _Filtered(cutoff, values, ids)
