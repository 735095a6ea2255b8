"""A verify step's rows see the drafts before them as outputs: row i of a request that
checks drafts d_0..d_{k-1} must get the distribution the sampler would give after the
request's tokens and d_0..d_{i-1}, penalties and min_tokens included. Each row of one
verify batch is compared with a state where those drafts were really sampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sample import Sampler, SamplingState
from engine.sample.sampler import process_logits
from engine.sampling_params import SamplingParams

VOCAB = 32
EOS = 3
PROMPT, OUTPUTS = [1, 2, 9], [5, 6, 5]
HISTORY_RULES = [
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4),
    SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[4]),
    SamplingParams(temperature=0.8, top_k=6, repetition_penalty=1.3, frequency_penalty=0.5,
                   min_tokens=6, seed=3),
]


@pytest.mark.parametrize("params", HISTORY_RULES, ids=str)
def test_each_verify_row_counts_the_drafts_before_it(params):
    drafts = [7, 7, EOS, 4, 5]  # repeated ids, EOS and a stop id among them
    other = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    state = SamplingState(4, VOCAB, "cpu")
    state.add_request(0, other, [8], [8, 8], EOS)
    state.add_request(2, params, PROMPT, OUTPUTS, EOS)
    # The step's rows: request 2 checking its drafts (1 + 5 rows), then request 0 (one row).
    rows = np.array([2] * (len(drafts) + 1) + [0])
    offsets = np.array(list(range(len(drafts) + 1)) + [0])
    draft_ids = np.array(drafts + [-1, -1])
    md = state.make_metadata(rows, offsets, draft_ids)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1))
    processed = process_logits(logits.clone(), md)  # the rules over each row's history
    probs = Sampler().probs(logits, md)  # and the distribution the row samples from

    def alone(row: int, state: SamplingState, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        one = state.make_metadata(np.array([row]))
        return process_logits(logits[i:i + 1].clone(), one), Sampler().probs(logits[i:i + 1], one)

    differs = 0
    for i in range(len(drafts) + 1):
        reference = SamplingState(4, VOCAB, "cpu")
        reference.add_request(2, params, PROMPT, OUTPUTS + drafts[:i], EOS)
        want_logits, want_probs = alone(2, reference, i)
        assert torch.equal(processed[i:i + 1], want_logits)
        assert torch.equal(probs[i:i + 1], want_probs)
        if i:  # the drafts change something (else this test could not fail)
            differs += not torch.equal(alone(2, state, i)[0], want_logits)
    assert differs == len(drafts) if params.min_tokens == 0 else differs > 0
    last = len(rows) - 1
    assert torch.equal(processed[last:], alone(0, state, last)[0])
