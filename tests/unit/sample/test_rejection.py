"""Draft verification (engine/sample/rejection.py): greedy exactness, and a chi-square
check that rejection sampling keeps the target distribution, which a mutated
acceptance rule or residual fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sample import SamplingState, rejection
from engine.sample.rejection import DraftVerifier
from engine.sampling_params import SamplingParams

VOCAB = 8
# Three logits rows of one request verifying drafts [2, 5]: row 0 checks draft 2,
# row 1 (after 2) checks draft 5, row 2 (after 2, 5) is the bonus row.
LOGITS = torch.tensor([
    [1.0, 0.2, 0.8, -0.5, 0.0, 0.4, -1.0, 0.3],
    [0.1, 0.9, -0.2, 0.3, 0.0, 0.7, -0.8, 0.5],
    [0.5, -0.3, 0.2, 0.8, -1.0, 0.0, 0.6, -0.2],
])
DRAFTS = [2, 5]
TEMPERATURE, TOP_K = 0.8, 6


def target_probs(row: torch.Tensor) -> torch.Tensor:
    """The ordinary sampler's distribution: softmax(logits / T) over the top-k tokens."""
    scaled = row.double() / TEMPERATURE
    kept = scaled.topk(TOP_K).indices
    probs = torch.zeros(VOCAB, dtype=torch.float64)
    probs[kept] = torch.softmax(scaled[kept], -1)
    return probs


def chi_square(tokens: np.ndarray, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of `tokens` against `probs` (its non-zero entries);
    a token outside the support makes the statistic infinite."""
    counts = np.bincount(tokens, minlength=VOCAB).astype(np.float64)
    support = probs.numpy() > 0
    if counts[~support].any():
        return float("inf"), int(support.sum()) - 1
    expected = probs.numpy()[support] * len(tokens)
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


# chi2 critical values at p = 0.001 by degrees of freedom.
CRITICAL = {4: 18.47, 5: 20.52}


def verify_many(num_requests: int, seeded: bool = False, seed: int = 0):
    """Verify the same draft for many requests at once; returns (emitted [n, 3], accepted)."""
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K,
                             seed=(i if seeded else None)) for i in range(num_requests)]
    state = SamplingState(num_requests, VOCAB, "cpu")
    for row, p in enumerate(params):
        state.add_request(row, p, [1], [], None)
    num_rows = np.full(num_requests, 3)
    md = state.make_metadata(np.repeat(np.arange(num_requests), 3))
    drafts = np.tile(np.array(DRAFTS + [-1]), num_requests)
    verifier = DraftVerifier(torch.Generator().manual_seed(seed))
    verified = verifier(LOGITS.repeat(num_requests, 1), md, drafts, num_rows)
    return verified.emitted_token_ids.reshape(num_requests, 3), verified.num_accepted


def statistics(emitted: np.ndarray, num_accepted: np.ndarray) -> list[tuple[float, int]]:
    """Chi-square of each position's token against its target distribution, over the
    requests that reached that position (accepted every draft before it)."""
    results = []
    for pos in range(3):
        reached = num_accepted >= pos
        results.append(chi_square(emitted[reached, pos], target_probs(LOGITS[pos])))
    return results


@pytest.mark.parametrize("seeded", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(seeded):
    emitted, num_accepted = verify_many(6000, seeded)
    # Rows before a request's first rejection emit its drafts; the rest are consistent.
    for pos, draft in enumerate(DRAFTS):
        assert (emitted[num_accepted > pos, pos] == draft).all()
        assert (emitted[num_accepted == pos, pos] != draft).all()
    assert 0 < (num_accepted == 2).sum() < len(num_accepted)
    for stat, dof in statistics(emitted, num_accepted):
        assert stat < CRITICAL[dof], (stat, dof)


@pytest.mark.parametrize("mutation", ["accept_too_often", "keep_draft_in_residual"])
def test_a_mutated_rule_fails_the_check(mutation, monkeypatch):
    if mutation == "accept_too_often":
        monkeypatch.setattr(rejection, "acceptance_probability", lambda p: p.sqrt())
    else:
        monkeypatch.setattr(rejection, "residual_probs", lambda probs, drafts, has: probs)
    emitted, num_accepted = verify_many(6000)
    stat, dof = statistics(emitted, num_accepted)[0]
    assert stat > CRITICAL[dof] * 5, (mutation, stat)


def test_greedy_rows_accept_exactly_the_argmax():
    state = SamplingState(2, VOCAB, "cpu")
    state.add_request(0, SamplingParams(temperature=0.0), [1], [], None)
    state.add_request(1, SamplingParams(temperature=0.0), [1], [], None)
    argmax = LOGITS.argmax(-1).tolist()  # [0, 1, 3]
    # Request 0 verifies [argmax0, wrong]; request 1 has no draft.
    drafts = np.array([argmax[0], 7, -1, -1])
    rows = np.array([0, 0, 0, 1])
    logits = torch.cat([LOGITS, LOGITS[:1]])
    verified = DraftVerifier()(logits, state.make_metadata(rows), drafts, np.array([3, 1]))
    assert verified.num_accepted.tolist() == [1, 0]
    assert verified.emitted_token_ids[:2].tolist() == [argmax[0], argmax[1]]
    assert verified.emitted_token_ids[3] == argmax[0]
