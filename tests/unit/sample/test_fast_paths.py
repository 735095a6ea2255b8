"""The sampling path's shortcuts equal the general path they skip: the metadata of a
batch of plain greedy rows vs the full gather, greedy and sampled draft verification vs
a per-request reference (argmax ties included), and a repeated row in
`append_output_tokens` vs one token at a time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.sample import Sampler, SamplingState
from engine.sample.metadata import SamplingMetadata
from engine.sample.rejection import DraftVerifier
from engine.sampling_params import SamplingParams

VOCAB = 64
EOS = 3
GREEDY = SamplingParams(temperature=0.0)
# Greedy rows with something to apply, and sampled rows: never the plain fast path.
NOT_PLAIN = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, logprobs=2),
    SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
    SamplingParams(temperature=0.0, min_tokens=4),
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=0.7, top_k=5, seed=11),
]


def assert_metadata_equal(a: SamplingMetadata, b: SamplingMetadata) -> None:
    for field in dataclasses.fields(SamplingMetadata):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None and torch.equal(x, y), field.name
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert np.array_equal(x, y) and x.dtype == y.dtype, field.name
        else:
            assert x == y, field.name  # generators compare by identity


def tied_logits(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Small integer logits: most rows have several tokens tied at their maximum."""
    return torch.randint(0, 4, (rows, VOCAB), generator=generator).float()


def test_plain_greedy_metadata_equals_the_full_gather():
    params = [GREEDY] * 4 + NOT_PLAIN
    state = SamplingState(len(params), VOCAB, "cpu")
    for row, p in enumerate(params):
        state.add_request(row, p, [1, 2], [], EOS)
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        # Plain rows only, repeated as in a verify step: the fast path.
        rows = rng.integers(0, 4, size=rng.integers(1, 9))
        md = state.make_metadata(rows)
        assert md.all_greedy
        assert_metadata_equal(md, state._gather_metadata(rows))
        logits = tied_logits(len(rows), generator)
        expected = logits.argmax(dim=-1)  # ties: the lowest index
        assert torch.equal(Sampler()(logits.clone(), md).sampled_token_ids, expected)
        # One row with something to apply: the full gather.
        mixed = np.append(rows, 4 + trial % len(NOT_PLAIN))
        assert_metadata_equal(state.make_metadata(mixed), state._gather_metadata(mixed))
    # A freed row loses its flag: reused by a penalised request it is gathered again.
    state.remove_request(0)
    state.add_request(0, NOT_PLAIN[0], [1, 2], [], EOS)
    assert state.make_metadata(np.array([0, 1])).penalty_rows.tolist() == [0]


def reference_verify(emitted_candidates: np.ndarray, accepted: np.ndarray,
                     draft_token_ids: np.ndarray, num_rows: np.ndarray) -> list[list[int]]:
    """Each request's tokens, one request at a time: its drafts up to the first row not
    accepted, then that row's own token (`emitted_candidates`)."""
    tokens, start = [], 0
    for n in num_rows.tolist():
        a = 0
        while accepted[start + a]:
            a += 1
        tokens.append(draft_token_ids[start:start + a].tolist()
                      + [int(emitted_candidates[start + a])])
        start += n
    return tokens


def emitted_per_request(verified, num_rows: np.ndarray) -> list[list[int]]:
    starts = np.cumsum(num_rows) - num_rows
    return [verified.emitted_token_ids[s:s + a + 1].tolist()
            for s, a in zip(starts.tolist(), verified.num_accepted.tolist(), strict=True)]


def random_drafts(argmax: np.ndarray, num_rows: np.ndarray,
                  rng: np.random.Generator) -> np.ndarray:
    """Per request, drafts that mostly equal the row's argmax (long accepted runs), else
    a random token (often one tied with the argmax at a higher index: rejected)."""
    drafts = np.where(rng.random(len(argmax)) < 0.75, argmax,
                      rng.integers(0, VOCAB, len(argmax)))
    drafts[np.cumsum(num_rows) - 1] = -1  # each request's last row has no draft
    return drafts


@pytest.mark.parametrize("trial", range(4))
def test_greedy_verification_equals_per_request_reference(trial):
    rng = np.random.default_rng(trial)
    generator = torch.Generator().manual_seed(trial)
    num_rows = rng.integers(1, 9, size=5)
    state = SamplingState(5, VOCAB, "cpu")
    for row in range(5):
        state.add_request(row, GREEDY, [1], [], EOS)
    logits = tied_logits(int(num_rows.sum()), generator)
    argmax = logits.argmax(dim=-1).numpy()
    drafts = random_drafts(argmax, num_rows, rng)
    md = state.make_metadata(np.repeat(np.arange(5), num_rows))
    verified = DraftVerifier()(logits.clone(), md, drafts, num_rows)
    accepted = (drafts >= 0) & (drafts == argmax)
    assert emitted_per_request(verified, num_rows) == \
        reference_verify(argmax, accepted, drafts, num_rows)


def test_sampled_verification_equals_per_request_reference(monkeypatch):
    """Greedy, seeded and unseeded sampled requests in one verify step: the
    bookkeeping of the rows' own draws (accepted or not, residual token) per request."""
    params = [GREEDY, SamplingParams(temperature=0.8, seed=5),
              SamplingParams(temperature=1.0, top_k=8), GREEDY,
              SamplingParams(temperature=0.6, top_p=0.9, seed=9)]
    rng = np.random.default_rng(7)
    state = SamplingState(len(params), VOCAB, "cpu")
    for row, p in enumerate(params):
        state.add_request(row, p, [1], [], EOS)
    num_rows = np.array([4, 6, 3, 1, 5])
    # One likely token per row, so sampled rows accept drafts too.
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(int(num_rows.sum()), VOCAB, generator=generator)
    logits[torch.arange(len(logits)), torch.randint(0, VOCAB, (len(logits),),
                                                     generator=generator)] += 7.0
    drafts = random_drafts(logits.argmax(dim=-1).numpy(), num_rows, rng)
    draws = []
    real = DraftVerifier._verify_random

    def spy(self, *args):
        draws.append(real(self, *args))
        return draws[-1]

    monkeypatch.setattr(DraftVerifier, "_verify_random", spy)
    md = state.make_metadata(np.repeat(np.arange(len(params)), num_rows))
    verified = DraftVerifier(torch.Generator().manual_seed(3))(logits, md, drafts, num_rows)
    (candidates, accepted), = draws
    assert emitted_per_request(verified, num_rows) == \
        reference_verify(candidates, accepted, drafts, num_rows)
    sampled = np.repeat([not p.greedy for p in params], num_rows)
    assert accepted[sampled].any() and not accepted[sampled & (drafts >= 0)].all()


def test_repeated_rows_count_like_one_token_at_a_time():
    """A verify step appends several tokens of one row at once: penalties and
    min_tokens see the same counts as appending them one by one."""
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5, min_tokens=5),
              SamplingParams(temperature=0.0, presence_penalty=0.2, min_tokens=2)]
    rows, tokens = np.array([0, 0, 1, 0, 1]), np.array([5, 5, 6, 7, 6])
    states = [SamplingState(2, VOCAB, "cpu") for _ in range(2)]
    for state in states:
        for row, p in enumerate(params):
            state.add_request(row, p, [1], [], EOS)
    states[0].append_output_tokens(rows, tokens)
    for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
        states[1].append_output_token(row, token)
    batched, one_by_one = (state.make_metadata(np.array([0, 1])) for state in states)
    assert_metadata_equal(batched, one_by_one)
    assert batched.output_counts[0, 5] == 2 and batched.output_counts[1, 6] == 2
    assert batched.min_tokens_rows.tolist() == [0]  # row 1 has its 2 tokens


def test_output_counts_kept_while_a_row_reads_them():
    """Outputs are counted only while some row has min_tokens masking or a penalty: a
    row that joins later, and one whose request leaves, still see exact counts."""
    state = SamplingState(3, VOCAB, "cpu")
    state.add_request(0, GREEDY, [1], [], EOS)
    state.append_output_tokens(np.array([0]), np.array([5]))  # nobody reads counts yet
    state.add_request(1, SamplingParams(temperature=0.0, min_tokens=2), [1], [], EOS)
    rows = np.array([0, 1])
    assert state.make_metadata(rows).min_tokens_rows.tolist() == [1]
    state.append_output_tokens(rows, np.array([5, 6]))
    assert state.make_metadata(rows).min_tokens_rows.tolist() == [1]  # 1 of 2 outputs
    state.append_output_token(1, 7)
    assert state.make_metadata(rows).min_tokens_rows is None
    state.remove_request(1)
    state.append_output_tokens(np.array([0]), np.array([5]))
    state.add_request(2, SamplingParams(temperature=0.0, min_tokens=1), [1], [9], EOS)
    assert state.make_metadata(np.array([0, 2])).min_tokens_rows is None  # resumed: 1 output
    state.remove_request(2)
    state.add_request(2, SamplingParams(temperature=0.0, min_tokens=1), [1], [], EOS)
    assert state.make_metadata(np.array([2])).min_tokens_rows.tolist() == [0]
    state.append_output_tokens(np.array([0, 2]), np.array([5, 8]))
    assert state.make_metadata(np.array([2])).min_tokens_rows is None
