"""benchmarks/perplexity.py's protocol (llama-perplexity's): chunks, the scored half, the
figure and its error."""

from __future__ import annotations

import math
from types import SimpleNamespace

from benchmarks.perplexity import chunks_of, perplexity_of, scored_logprobs


def test_chunks_of_the_docstrings_example():
    ids = [9, 5, 6, 7, 8, 3, 4, 2, 1]
    assert chunks_of(ids, 4, 9, None) == [[9, 5, 6, 7], [9, 3, 4, 2]]
    assert chunks_of(ids, 4, None, 1) == [[9, 5, 6, 7]]


def test_only_the_second_half_is_scored():
    # prompt_logprobs entry i: token i given tokens < i (entry 0 has none).
    entries = [None] + [SimpleNamespace(logprob=-float(i)) for i in range(1, 8)]
    assert scored_logprobs(entries, 8) == [-5.0, -6.0, -7.0]  # tokens 5, 6, 7 of 8


def test_perplexity_is_exp_of_the_mean_nll_with_its_standard_error():
    value, stderr = perplexity_of([-1.0, -3.0])
    assert math.isclose(value, math.exp(2.0))
    # NLL 1 and 3: sample variance 2, standard error of the mean 1, through the exp.
    assert math.isclose(stderr, math.exp(2.0) * 1.0)
