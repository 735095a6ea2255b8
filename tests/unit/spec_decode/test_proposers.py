"""The n-gram and suffix proposers, and the speculator's back-off."""

from __future__ import annotations

import numpy as np
import pytest

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from engine.spec_decode import DRAFT_PLACEHOLDER, Speculator, find_ngram_draft
from engine.spec_decode.suffix import SuffixIndex
from engine.structured_output.params import StructuredOutputsParams


def brute_force_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: the longest n in [min_n, max_n] whose suffix occurs earlier with a
    token after it; of those occurrences the earliest; the up to k tokens after it."""
    num = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= num:
            continue
        suffix = tokens[num - n:]
        for end in range(n - 1, num - 1):  # end position of an occurrence
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + k]
    return []


def ngram(tokens, min_n=2, max_n=5, k=4) -> list[int]:
    return find_ngram_draft(np.asarray(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def test_worked_example():
    assert ngram([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 4) == [9, 1, 2, 3]


def test_longest_match_wins_over_an_earlier_shorter_one():
    # [1, 2] first occurs followed by 3; [8, 1, 2] (the longer suffix) only later.
    tokens = [1, 2, 3, 4, 8, 1, 2, 6, 8, 1, 2]
    assert ngram(tokens, 2, 3, 2) == [6, 8]
    assert ngram(tokens, 2, 2, 2) == [3, 4]


def test_no_match_and_limits():
    assert ngram([1, 2, 3, 4]) == []
    assert ngram([1, 2, 1, 2], min_n=3) == []  # the suffix [1, 2] is too short to count
    assert ngram([1]) == []
    assert ngram([1, 2, 1, 2], k=0) == []
    # The draft stops at the end of the text: [1, 2] -> followed by [1, 2] only.
    assert ngram([1, 2, 1, 2], k=4) == [1, 2]


def test_matches_brute_force_on_random_texts():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=rng.integers(1, 40)).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 3))
        assert ngram(tokens, min_n, max_n, 3) == brute_force_draft(tokens, min_n, max_n, 3), (
            tokens, min_n, max_n)


def test_suffix_index_finds_other_sequences_and_stays_bounded():
    index = SuffixIndex(min_n=2, max_n=4, max_sequences=2)
    index.add(np.array([1, 2, 3, 4, 5, 6]))
    index.add(np.array([9, 2, 3, 7, 8]))
    # [.. 1, 2, 3] matches the first sequence for 3 tokens, the second for only 2.
    assert index.propose(np.array([0, 1, 2, 3]), 2).tolist() == [4, 5]
    assert index.propose(np.array([0, 9, 2, 3]), 2).tolist() == [7, 8]
    assert index.propose(np.array([5, 5]), 2).tolist() == []
    index.add(np.array([40, 41, 42]))  # evicts the oldest
    assert index.num_sequences == 2
    assert index.propose(np.array([0, 1, 2, 3]), 2).tolist() == [7, 8]
    assert all(seq_id in index._sequences for ends in index._ends.values() for seq_id, _ in ends)


class _Request:
    def __init__(self, req_id, tokens, params=None):
        self.req_id = req_id
        self.all_token_ids = list(tokens)
        self.num_prompt_tokens = len(tokens)
        self.sampling_params = params or SamplingParams(temperature=0.0)

    @property
    def num_output_tokens(self):
        return len(self.all_token_ids) - self.num_prompt_tokens


def test_speculator_backs_off_after_low_acceptance_then_retries():
    speculator = Speculator(SpeculativeConfig(
        num_speculative_tokens=4, backoff_min_draft_tokens=8, backoff_tokens=10,
        min_acceptance_rate=0.5, adaptive_draft_length=False))
    request = _Request("a", [1, 2, 3, 1, 2, 3, 1, 2])
    assert speculator.propose(request, 8) == [3, 1, 2]  # the text ends after 3 tokens
    speculator.record("a", 3, 0, 9)
    speculator.record("a", 5, 1, 10)  # 1 of 8 accepted: pause until 20 tokens
    request.all_token_ids += [3, 1]
    assert speculator.propose(request, 8) == []
    request.all_token_ids += [2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
    assert speculator.propose(request, 8) == [3, 1, 2, 3]
    assert speculator.acceptance("a") == (8, 1)
    stats = speculator.take_stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 8, 1)
    assert stats.num_accepted_tokens_per_pos == [1, 0, 0, 0]  # per position up to k
    assert speculator.take_stats().num_drafts == 0


def test_back_off_doubles_while_drafts_keep_failing_and_resets_after_a_good_window():
    speculator = Speculator(SpeculativeConfig(
        num_speculative_tokens=8, backoff_min_draft_tokens=8, backoff_tokens=10,
        min_acceptance_rate=0.5, adaptive_draft_length=False))
    request = _Request("a", [1, 2, 3, 1, 2, 3, 1, 2])
    speculator.propose(request, 8)
    pauses = []
    num_tokens = 100
    for accepted in (0, 0, 0, 8, 0, 0, 0, 0, 0, 0):  # one window of 8 draft tokens each
        speculator.record("a", 8, accepted, num_tokens)
        state = speculator._states["a"]
        pauses.append(state.paused_until - num_tokens if state.paused_until > num_tokens else 0)
        num_tokens = max(num_tokens, state.paused_until)
    # 10, 20, 40 tokens; a good window resets; then 10, 20, 40, 80, 160 and no further.
    assert pauses == [10, 20, 40, 0, 10, 20, 40, 80, 160, 160]


def test_adaptive_draft_length_follows_acceptance():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=8))
    request = _Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2])
    assert speculator.propose(request, 16) == [3, 4, 5, 6, 7, 8, 9, 10]  # k to start
    speculator.record("a", 8, 2, 17)  # rejected at position 2: next time 3
    assert speculator.propose(request, 16) == [3, 4, 5]
    speculator.record("a", 3, 3, 21)  # all accepted: twice as long
    assert speculator.propose(request, 16) == [3, 4, 5, 6, 7, 8]
    speculator.record("a", 6, 6, 28)
    assert speculator.propose(request, 16) == [3, 4, 5, 6, 7, 8, 9, 10]  # at most k
    assert speculator.propose(request, 2) == [3, 4]  # and at most what the step allows
    speculator.record("a", 8, 0, 29)
    assert speculator.propose(request, 16) == [3]  # never below one
    fixed = Speculator(SpeculativeConfig(num_speculative_tokens=8, adaptive_draft_length=False))
    fixed.propose(request, 16)
    fixed.record("a", 8, 0, 29)
    assert len(fixed.propose(request, 16)) == 8


def test_speculator_respects_limits_and_sampling_rules():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert speculator.propose(_Request("a", tokens), 2) == [3, 1]
    assert speculator.propose(_Request("b", tokens), 0) == []
    # History rules take part: each verified row counts the drafts before it
    # (tests/unit/sample/test_verify_rows.py).
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert speculator.propose(_Request("c", tokens, penalised), 4) == [3, 1, 2]
    min_tokens = SamplingParams(temperature=0.0, min_tokens=3)
    assert speculator.propose(_Request("d", tokens, min_tokens), 4) == [3, 1, 2]


def test_draft_model_speculator_proposes_placeholders_within_the_same_limits():
    """draft_model: the runner's draft model fills the tokens in; the scheduler-side
    rules (room, sampling rules, adaptive length, back-off) are the n-gram ones."""
    speculator = Speculator(SpeculativeConfig(method="draft_model", model="/draft",
                                              num_speculative_tokens=4))
    tokens = [5, 6, 7]  # nothing to look up: a draft model proposes anyway
    assert speculator.propose(_Request("a", tokens), 16) == [DRAFT_PLACEHOLDER] * 4
    assert speculator.propose(_Request("b", tokens), 2) == [DRAFT_PLACEHOLDER] * 2
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    assert speculator.propose(_Request("c", tokens, penalised), 4) == [DRAFT_PLACEHOLDER] * 4
    speculator.record("a", 4, 1, 5)  # rejected at position 1: the next draft is 2 long
    assert speculator.propose(_Request("a", tokens), 16) == [DRAFT_PLACEHOLDER] * 2
    # The scheduler cannot check placeholders against a grammar: constrained requests
    # decode one token at a time with a draft model (they do speculate with n-grams).
    regex = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(
        kind="regex", spec="[0-9]+"))
    assert speculator.propose(_Request("e", tokens, regex), 4) == []
    assert not speculator.may_propose(_Request("f", tokens, regex))
    ngram_speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    assert ngram_speculator.propose(_Request("e", [1, 2, 3, 1, 2], regex), 4) == [3, 1, 2]


def test_suffix_speculator_learns_from_finished_requests():
    speculator = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=3))
    done = _Request("a", [7, 8, 9])
    done.all_token_ids += [10, 11, 12]  # its output
    speculator.finish(done)
    assert speculator.propose(_Request("b", [1, 8, 9]), 3) == [10, 11, 12]


@pytest.mark.parametrize("bad, message", [
    ({"method": "eagle"}, "not supported"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"typo": 1}, "unknown speculative_config keys"),
    ({"method": "draft_model"}, 'needs "model"'),
    ({"method": "suffix", "model": "/m"}, "takes none"),
])
def test_config_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(bad)


def test_config_from_vllm_json():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 1})
    assert (config.num_speculative_tokens, config.prompt_lookup_min,
            config.prompt_lookup_max) == (3, 1, 1)


def test_cli_flag_as_vllm_spells_it():
    from server.http.cli import engine_config_from_args, make_arg_parser

    parser = make_arg_parser()
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", '
                              '"num_speculative_tokens": 3, "prompt_lookup_min": 2, '
                              '"prompt_lookup_max": 4}'])
    config = engine_config_from_args(args, "/m", "m").speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == (
        "ngram", 3, 4)
    assert engine_config_from_args(parser.parse_args([]), "/m", "m").speculative_config is None
    args = parser.parse_args(["--speculative-config", '{"method": "draft_model", '
                              '"model": "/models/small", "num_speculative_tokens": 4}'])
    config = engine_config_from_args(args, "/m", "m").speculative_config
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model", "/models/small", 4)
    config = engine_config_from_args(parser.parse_args(
        ["--speculative-config", '{"method": "draft_model", "model": "/models/small"}',
         "--tensor-parallel-size", "2"]), "/m", "m")  # each rank runs the whole draft
    assert (config.speculative_config.method, config.parallel_config.tensor_parallel_size) == (
        "draft_model", 2)
    for bad in ('{"method": "ngram"', '[1]', '{"num_speculative_tokens": 99}',
                '{"method": "draft_model"}'):
        with pytest.raises(SystemExit):
            parser.parse_args(["--speculative-config", bad])
