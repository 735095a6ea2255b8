"""Sampler tests: each stage against a naive per-row reference, seeded
determinism across batches, logprobs, and a distribution check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.sample import Sampler, SamplingState, compute_prompt_logprobs
from engine.sample.sampler import process_logits
from engine.sampling_params import SamplingParams

EOS = 3


def make_state(params_list, vocab, prompts=None, outputs=None, max_num_reqs=None):
    """A state with request i in row i; returns (state, rows)."""
    n = len(params_list)
    state = SamplingState(max_num_reqs or max(n, 1), vocab, "cpu")
    for i, params in enumerate(params_list):
        prompt = prompts[i] if prompts else [1, 2]
        output = outputs[i] if outputs else []
        state.add_request(i, params, prompt, output, EOS)
    return state, np.arange(n)


# ----------------------------------------------------------------- naive references
def ref_kept(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Tokens a row may sample: top-k, then top-p on the renormalised rest, then min-p.

    Returns (kept set, ambiguous) where ambiguous means a float32 implementation
    could legitimately decide a boundary the other way.
    """
    scaled = np.asarray(logits_row, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    weights = np.exp(scaled[order] - scaled[order[0]])
    probs = weights / weights.sum()
    cum = np.cumsum(probs)
    ambiguous = False
    if top_p < 1.0:
        n = int(np.searchsorted(cum, top_p) + 1)  # first prefix whose mass reaches top_p
        ambiguous |= bool(np.any(np.abs(cum - top_p) < 1e-4))
        order = order[:n]
    kept = set(order.tolist())
    if min_p > 0.0:
        ratio = np.exp(scaled - scaled.max())
        ambiguous |= bool(np.any(np.abs(ratio - min_p) < 1e-4 * max(min_p, 1e-3)))
        kept = {i for i in kept if ratio[i] >= min_p}
    return kept, ambiguous


def ref_penalties(logits_row, prompt, output, rep, freq, pres):
    x = np.asarray(logits_row, np.float64).copy()
    counts = np.bincount(np.asarray(output, np.int64), minlength=len(x)) if output else np.zeros(len(x))
    seen = set(prompt) | set(output)
    for t in seen:
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    x -= freq * counts
    x -= pres * (counts > 0)
    return x


# ----------------------------------------------------------------- greedy / temperature
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    torch.manual_seed(0)
    vocab = 500
    state, rows = make_state([SamplingParams(temperature=0.0)] * 9, vocab)
    md = state.make_metadata(rows)
    assert md.all_greedy and md.temperature is None and md.no_top_k and md.no_top_p
    assert md.no_min_p and md.no_penalties and md.no_logit_bias and md.max_num_logprobs is None
    logits = (torch.randn(9, vocab) * 3).to(dtype)
    expected = logits.float().argmax(-1)
    out = Sampler()(logits.clone(), md)
    assert out.sampled_token_ids.dtype == torch.long
    assert torch.equal(out.sampled_token_ids, expected)
    assert out.logprobs is None


def test_temperature_probs_match_softmax():
    torch.manual_seed(1)
    vocab = 300
    temps = [0.3, 0.7, 1.0, 1.5, 2.0]
    state, rows = make_state([SamplingParams(temperature=t) for t in temps], vocab)
    md = state.make_metadata(rows)
    assert md.no_top_k and md.no_top_p and md.no_min_p
    logits = torch.randn(len(temps), vocab) * 2
    probs = Sampler().probs(logits, md)
    expected = torch.softmax(logits.double() / torch.tensor(temps).double()[:, None], -1)
    torch.testing.assert_close(probs.double(), expected, rtol=1e-4, atol=1e-7)


def test_plain_temperature_one_skips_temperature():
    state, rows = make_state([SamplingParams(temperature=1.0)] * 3, 50)
    md = state.make_metadata(rows)
    assert md.all_random and md.temperature is None and md.generators == {}


# ----------------------------------------------------------------- filters vs reference
def _filter_cases(rng, vocab, num_rows, make_params, scale_range=(0.5, 4.0)):
    """Random (logits, params) rows whose reference decision is unambiguous."""
    logits_rows, params = [], []
    while len(params) < num_rows:
        scale = rng.uniform(*scale_range)
        row = rng.standard_normal(vocab).astype(np.float32) * np.float32(scale)
        p = make_params(rng)
        ambiguous = not p.greedy and ref_kept(row, p.temperature, p.top_k, p.top_p, p.min_p)[1]
        if not ambiguous:
            logits_rows.append(row)
            params.append(p)
    return torch.from_numpy(np.stack(logits_rows)), params


def _check_kept_sets(logits, params, vocab):
    state, rows = make_state(params, vocab)
    md = state.make_metadata(rows)
    probs = Sampler().probs(logits, md)
    for i, p in enumerate(params):
        kept, _ = ref_kept(logits[i].numpy(), p.temperature, p.top_k, p.top_p, p.min_p)
        got = set(torch.nonzero(probs[i] > 0).flatten().tolist())
        assert got == kept, f"row {i} {p}: {len(got)} vs {len(kept)} tokens"
        torch.testing.assert_close(probs[i].sum(), torch.tensor(1.0))
    return md


def test_top_k_matches_reference():
    rng = np.random.default_rng(2)
    vocab = 400

    def params(rng):
        return SamplingParams(temperature=float(rng.uniform(0.5, 1.5)),
                              top_k=int(rng.choice([0, 1, 2, 5, 50, 399, 400, 1000])))

    logits, plist = _filter_cases(rng, vocab, 24, params)
    md = _check_kept_sets(logits, plist, vocab)
    assert not md.no_top_k and md.no_top_p


def test_top_p_matches_reference():
    rng = np.random.default_rng(3)
    vocab = 600

    def params(rng):
        return SamplingParams(temperature=float(rng.uniform(0.5, 1.5)),
                              top_p=float(rng.choice([0.05, 0.3, 0.5, 0.8, 0.95, 1.0])))

    logits, plist = _filter_cases(rng, vocab, 24, params)
    md = _check_kept_sets(logits, plist, vocab)
    assert md.no_top_k and not md.no_top_p


def test_top_p_keeps_at_least_one_token():
    vocab = 50
    logits = torch.zeros(2, vocab)
    logits[:, 7] = 20.0  # nearly all the mass on one token
    state, rows = make_state([SamplingParams(top_p=1e-6), SamplingParams(top_p=0.01)], vocab)
    probs = Sampler().probs(logits, state.make_metadata(rows))
    assert torch.equal(probs[:, 7], torch.ones(2))
    assert int((probs > 0).sum()) == 2


def test_top_p_long_nucleus_falls_back_to_full_sort():
    """Flat rows whose nucleus exceeds the top-p candidate window, beside peaked
    rows and a top-k larger than the window."""
    rng = np.random.default_rng(4)
    vocab = 4096

    def params(rng):
        return SamplingParams(top_p=float(rng.choice([0.5, 0.9, 0.99])),
                              top_k=int(rng.choice([0, 0, 2000])))

    logits, plist = _filter_cases(rng, vocab, 8, params, scale_range=(0.2, 0.6))
    peaked, plist2 = _filter_cases(rng, vocab, 4, params, scale_range=(3.0, 5.0))
    logits = torch.cat([logits, peaked])
    plist = plist + plist2
    sizes = [len(ref_kept(logits[i].numpy(), p.temperature, p.top_k, p.top_p)[0])
             for i, p in enumerate(plist)]
    assert max(sizes) > 1024 and min(sizes) < 1024
    _check_kept_sets(logits, plist, vocab)


def test_sampling_reaches_nucleus_beyond_candidates():
    """A nucleus longer than the candidate window must be sampled over in full:
    draws land past the 1024 best tokens as often as the mass there says."""
    vocab = 1500
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(15)) * 0.3
    num_rows = 3000
    state, rows = make_state([SamplingParams(top_p=0.99)] * num_rows, vocab)
    md = state.make_metadata(rows)
    single, _ = make_state([SamplingParams(top_p=0.99)], vocab)
    probs = Sampler().probs(logits_row[None], single.make_metadata(np.array([0])))[0].double()
    order = torch.argsort(logits_row, descending=True)
    tail = order[1024:]
    tail_mass = float(probs[tail].sum())
    assert tail_mass > 0.15
    ids = Sampler(torch.Generator().manual_seed(16))(
        logits_row.expand(num_rows, vocab).clone(), md).sampled_token_ids
    in_tail = float(torch.isin(ids, tail).double().mean())
    assert abs(in_tail - tail_mass) < 4 * math.sqrt(tail_mass * (1 - tail_mass) / num_rows)


def test_min_p_matches_reference():
    rng = np.random.default_rng(5)
    vocab = 300

    def params(rng):
        return SamplingParams(temperature=float(rng.uniform(0.5, 1.5)),
                              min_p=float(rng.choice([0.0, 0.01, 0.1, 0.5, 1.0])))

    logits, plist = _filter_cases(rng, vocab, 24, params)
    md = _check_kept_sets(logits, plist, vocab)
    assert md.no_top_k and md.no_top_p and not md.no_min_p


@pytest.mark.parametrize("bounded", [False, True])
def test_combined_filters_match_reference(bounded):
    """bounded: every row has a top-k, so top-p only looks at max_top_k + 1 tokens."""
    rng = np.random.default_rng(6)
    vocab = 1500
    top_ks = [3, 40, 200] if bounded else [0, 3, 40, 200]

    def params(rng):
        return SamplingParams(
            temperature=float(rng.choice([0.0, 0.6, 1.0, 1.3])),
            top_k=int(rng.choice(top_ks)),
            top_p=float(rng.choice([0.4, 0.9, 1.0])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
        )

    logits, plist = _filter_cases(rng, vocab, 32, params)
    state, rows = make_state(plist, vocab)
    md = state.make_metadata(rows)
    assert md.top_p_unbounded == (not bounded)
    probs = Sampler().probs(logits, md)
    for i, p in enumerate(plist):
        if p.greedy:
            kept = {int(logits[i].argmax())}
        else:
            kept, _ = ref_kept(logits[i].numpy(), p.temperature, p.top_k, p.top_p, p.min_p)
        assert set(torch.nonzero(probs[i] > 0).flatten().tolist()) == kept
    # Every sampled token lies in its row's kept set.
    sampler = Sampler(torch.Generator().manual_seed(0))
    for _ in range(20):
        ids = sampler(logits.clone(), md).sampled_token_ids
        assert all(bool(probs[i, t] > 0) for i, t in enumerate(ids.tolist()))


# ----------------------------------------------------------------- penalties, bias, min_tokens
def test_penalties_match_reference():
    torch.manual_seed(7)
    vocab = 64
    rng = np.random.default_rng(7)
    cases = [(1.0, 0.0, 0.0), (1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 0.5, 0.0),
             (1.0, 0.0, 1.5), (1.2, -0.7, 0.4), (1.0, 0.0, -2.0)]
    params = [SamplingParams(temperature=0.0, repetition_penalty=r, frequency_penalty=f,
                             presence_penalty=p) for r, f, p in cases]
    prompts = [rng.integers(0, vocab, 10).tolist() for _ in cases]
    initial = [rng.integers(0, vocab, 5).tolist() for _ in cases]
    state, rows = make_state(params, vocab, prompts, initial)
    outputs = [list(o) for o in initial]
    for _ in range(3):  # more outputs arrive step by step
        for i in range(len(cases)):
            token = int(rng.integers(0, vocab))
            state.append_output_token(i, token)
            outputs[i].append(token)
    state.append_output_tokens(np.array([2, 5]), np.array([9, 9]))
    outputs[2].append(9)
    outputs[5].append(9)
    md = state.make_metadata(rows)
    assert md.penalty_rows is not None and md.penalty_rows.tolist() == [1, 2, 3, 4, 5, 6]
    logits = torch.randn(len(cases), vocab) * 3
    processed = process_logits(logits.clone(), md)
    for i, (r, f, p) in enumerate(cases):
        expected = ref_penalties(logits[i].numpy(), prompts[i], outputs[i], r, f, p)
        np.testing.assert_allclose(processed[i].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_penalty_slots_are_reused_and_reset():
    vocab = 32
    state = SamplingState(4, vocab, "cpu")
    params = SamplingParams(frequency_penalty=1.0, temperature=0.0)
    for round_ in range(6):
        for row in range(4):
            state.add_request(row, params, [0], [row + round_], EOS)
            state.append_output_token(row, 5)
        md = state.make_metadata(np.arange(4))
        counts = md.output_counts
        for row in range(4):
            expected = torch.zeros(vocab, dtype=torch.int32)
            expected[row + round_] += 1
            expected[5] += 1
            assert torch.equal(counts[row], expected)
        for row in range(4):
            state.remove_request(row)
    assert state._pen_counts.shape[0] == 4


def test_logit_bias():
    vocab = 20
    params = [SamplingParams(temperature=0.0, logit_bias={4: 100.0, 9: -100.0}),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={0: 2.5})]
    state, rows = make_state(params, vocab)
    md = state.make_metadata(rows)
    logits = torch.randn(3, vocab)
    processed = process_logits(logits.clone(), md)
    expected = logits.clone()
    expected[0, 4] += 100.0
    expected[0, 9] -= 100.0
    expected[2, 0] += 2.5
    torch.testing.assert_close(processed, expected)
    assert int(Sampler()(logits.clone(), md).sampled_token_ids[0]) == 4
    with pytest.raises(ValueError):
        SamplingState(2, vocab).add_request(0, SamplingParams(logit_bias={vocab: 1.0}), [], [], None)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos):
    vocab = 16
    stop_ids = [7, 11]
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=stop_ids,
                             ignore_eos=ignore_eos, max_tokens=10),
              SamplingParams(temperature=0.0, stop_token_ids=stop_ids)]
    state, rows = make_state(params, vocab, outputs=[[1], []])
    logits = torch.zeros(2, vocab)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 11] = 8.0
    masked = [EOS, 7, 11]
    for step in range(4):  # the row already has 1 output; 2 more keep the mask on
        md = state.make_metadata(rows)
        processed = process_logits(logits.clone(), md)
        if step < 2:
            assert all(processed[0, t] == float("-inf") for t in masked)
            assert int(Sampler()(logits.clone(), md).sampled_token_ids[0]) not in masked
        else:
            assert md.no_min_tokens
            torch.testing.assert_close(processed[0], logits[0])
        torch.testing.assert_close(processed[1], logits[1])  # row 1: no min_tokens
        state.append_output_token(0, 0)
        state.append_output_token(1, 0)


# ----------------------------------------------------------------- logprobs
def test_logprobs_match_log_softmax_and_ranks():
    torch.manual_seed(8)
    vocab = 200
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.8, logprobs=0, top_k=20),
              SamplingParams(temperature=1.0, logprobs=None),
              SamplingParams(temperature=1.2, logprobs=20, presence_penalty=1.0)]
    state, rows = make_state(params, vocab, outputs=[[], [], [], [4, 4, 9]])
    md = state.make_metadata(rows)
    assert md.max_num_logprobs == 20 and md.num_logprobs.tolist() == [5, 0, -1, 20]
    logits = torch.randn(4, vocab) * 2
    processed = process_logits(logits.clone(), state.make_metadata(rows))
    expected_lp = torch.log_softmax(processed, -1)  # processed, untempered
    for _ in range(5):
        out = Sampler()(logits.clone(), md)
        lp = out.logprobs
        assert lp.token_ids.shape == (4, 21) and lp.logprobs.shape == (4, 21)
        ids = out.sampled_token_ids
        assert torch.equal(lp.token_ids[:, 0], ids)
        for i in range(4):
            row = expected_lp[i]
            torch.testing.assert_close(lp.logprobs[i, 0], row[ids[i]])
            top_values, top_ids = row.topk(20)
            assert torch.equal(lp.token_ids[i, 1:], top_ids)
            torch.testing.assert_close(lp.logprobs[i, 1:], top_values)
            order = torch.argsort(row, descending=True).tolist()
            assert int(lp.ranks[i]) == order.index(int(ids[i])) + 1
        assert int(lp.ranks[0]) == 1  # greedy picks the best
        split = lp.split(md.num_logprobs)
        assert split[2] is None
        assert len(split[0].token_ids[0]) == 6 and len(split[1].token_ids[0]) == 1
        assert split[3].ranks == [int(lp.ranks[3])]


def test_prompt_logprobs():
    torch.manual_seed(9)
    logits = torch.randn(6, 50).to(torch.bfloat16)
    targets = torch.tensor([3, 1, 4, 1, 5, 9])
    lp = compute_prompt_logprobs(logits, targets, 3)
    full = torch.log_softmax(logits.float(), -1)
    assert lp.token_ids.shape == (6, 4)
    torch.testing.assert_close(lp.logprobs[:, 0], full[torch.arange(6), targets])
    top_values, top_ids = full.topk(3)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top_values)
    expected_ranks = (full > full[torch.arange(6), targets][:, None]).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)
    as_lists = lp.to_logprobs(num_top=1)
    assert len(as_lists.token_ids) == 6 and len(as_lists.token_ids[0]) == 2
    assert compute_prompt_logprobs(logits, targets, 0).token_ids.shape == (6, 1)


# ----------------------------------------------------------------- seeded determinism
TARGET = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.5, logprobs=2)


def _other_params(i):
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.3, top_p=0.5, seed=i),
        SamplingParams(min_p=0.2, logprobs=5),
        SamplingParams(temperature=0.5, repetition_penalty=1.3, frequency_penalty=0.3),
        SamplingParams(logit_bias={1: 3.0}, top_k=3000, top_p=0.9),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[2]),
    ]
    return kinds[i % len(kinds)]


def _target_logits(step, vocab, scale):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(vocab, generator=g) * scale


def _run_target(vocab, steps, batch_others, scale, interrupt_at=None, keep_generator=False):
    """Token sequence of TARGET, alone or among `batch_others` rows."""
    num_others = batch_others
    state = SamplingState(num_others + 1, vocab, "cpu")
    target_row = num_others // 2
    other_rows = [r for r in range(num_others + 1) if r != target_row]
    for i, row in enumerate(other_rows):
        state.add_request(row, _other_params(i), [5, 6, 7], [], EOS)
    state.add_request(target_row, TARGET, [5, 6, 7], [], EOS)
    perm_rng = np.random.default_rng(11)
    noise_gen = torch.Generator().manual_seed(99)
    sampler = Sampler(torch.Generator().manual_seed(batch_others))
    tokens, logprobs = [], []
    for step in range(steps):
        if step == interrupt_at:  # preempted and resumed
            generator = state.remove_request(target_row)
            state.add_request(target_row, TARGET, [5, 6, 7], list(tokens), EOS,
                              generator=generator if keep_generator else None)
        rows = np.array([target_row] + other_rows)
        perm_rng.shuffle(rows)
        md = state.make_metadata(rows)
        logits = torch.randn(len(rows), vocab, generator=noise_gen) * 3
        pos = int(np.flatnonzero(rows == target_row)[0])
        logits[pos] = _target_logits(step, vocab, scale)
        out = sampler(logits, md)
        token = int(out.sampled_token_ids[pos])
        tokens.append(token)
        logprobs.append(out.logprobs.logprobs[pos, :3].clone())
        state.append_output_tokens(rows, out.sampled_token_ids.numpy())
    return tokens, torch.stack(logprobs)


@pytest.mark.parametrize("scale", [1.5, 5.0])
def test_seeded_row_same_alone_and_in_batch(scale, monkeypatch):
    """scale 1.5: the target's nucleus exceeds the top-p candidates (full sort,
    full-vocab race). scale 5: alone it races over its candidates only, in the
    batch (plain-temperature neighbours) over the full vocab; same tokens."""
    calls = []
    candidate_race = Sampler._candidate_race
    monkeypatch.setattr(Sampler, "_candidate_race",
                        lambda self, f, md: calls.append(md.num_reqs) or candidate_race(self, f, md))
    vocab = 2500  # flat: nucleus of 1168-1291 tokens, past the 1024 candidates
    steps = 10
    alone, lp_alone = _run_target(vocab, steps, 0, scale)
    assert bool(calls) == (scale == 5.0)
    calls.clear()
    batched, lp_batched = _run_target(vocab, steps, 16, scale)
    assert not calls
    assert len(set(alone)) > 3  # really random, not degenerate
    assert alone == batched
    torch.testing.assert_close(lp_alone, lp_batched)
    if scale == 5.0:  # generator use is the same on both paths: check resume once
        # Preempted and resumed: a fresh generator is fast-forwarded; a kept one continues.
        assert _run_target(vocab, steps, 16, scale, interrupt_at=5)[0] == alone
        assert _run_target(vocab, steps, 16, scale, interrupt_at=5, keep_generator=True)[0] == alone


def test_same_seed_same_tokens_different_seed_differs():
    vocab = 1000
    params = [SamplingParams(seed=7), SamplingParams(seed=7), SamplingParams(seed=8),
              SamplingParams()]
    state, rows = make_state(params, vocab)
    md = state.make_metadata(rows)
    assert sorted(md.generators) == [0, 1, 2]
    seqs = [[], [], [], []]
    for _ in range(20):
        logits = torch.zeros(4, vocab)  # uniform: the noise decides
        for i, t in enumerate(Sampler()(logits, md).sampled_token_ids.tolist()):
            seqs[i].append(t)
    assert seqs[0] == seqs[1]
    assert seqs[0] != seqs[2]


# ----------------------------------------------------------------- distribution
def _chi_square(counts, probs, draws):
    expected = probs * draws
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_matches_softmax(seeded):
    vocab = 8
    num_rows, steps = 4000, 5
    logits_row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    params = [SamplingParams(temperature=1.0, seed=(i if seeded else None))
              for i in range(num_rows)]
    state, rows = make_state(params, vocab)
    md = state.make_metadata(rows)
    sampler = Sampler(torch.Generator().manual_seed(12))
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(steps):
        ids = sampler(logits_row.expand(num_rows, vocab).clone(), md).sampled_token_ids
        counts += torch.bincount(ids, minlength=vocab).double()
    probs = torch.softmax(logits_row.double(), -1)
    draws = num_rows * steps
    assert _chi_square(counts, probs, draws) < 24.3  # chi2(7 dof), p = 0.001
    assert float((counts / draws - probs).abs().max()) < 0.01


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_distribution_with_filters(seeded, monkeypatch):
    """Top-k + top-p over a vocab larger than the candidate window: the race runs
    over candidates only and must still follow the renormalised distribution."""
    calls = []
    candidate_race = Sampler._candidate_race
    monkeypatch.setattr(Sampler, "_candidate_race",
                        lambda self, f, md: calls.append(1) or candidate_race(self, f, md))
    vocab = 1500
    num_rows, steps = 2000, 3
    logits_row = torch.full((vocab,), -6.0)
    logits_row[:10] = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0, -3.0, 0.2])
    params = [SamplingParams(temperature=0.7, top_k=5 if i % 2 else 0, top_p=0.9,
                             seed=(i if seeded else None)) for i in range(num_rows)]
    state, rows = make_state(params, vocab)
    md = state.make_metadata(rows)
    kept, _ = ref_kept(logits_row.numpy(), 0.7, 5, 0.9)
    assert kept == ref_kept(logits_row.numpy(), 0.7, 0, 0.9)[0]  # both row kinds agree
    kept = sorted(kept)
    assert len(kept) == 3
    ref = torch.zeros(vocab, dtype=torch.float64)
    ref[kept] = torch.softmax(logits_row.double()[kept] / 0.7, -1)
    sampler = Sampler(torch.Generator().manual_seed(13))
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(steps):
        ids = sampler(logits_row.expand(num_rows, vocab).clone(), md).sampled_token_ids
        counts += torch.bincount(ids, minlength=vocab).double()
    draws = num_rows * steps
    assert calls
    assert counts[[i for i in range(vocab) if i not in kept]].sum() == 0
    stat = _chi_square(counts[kept], ref[kept], draws)
    assert stat < 13.8  # chi2(2 dof), p = 0.001


# ----------------------------------------------------------------- mixed batch == alone
def test_mixed_batch_equals_each_row_alone():
    torch.manual_seed(14)
    vocab = 3000
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=4),
        SamplingParams(temperature=1.0, logprobs=3),  # unseeded random
        SamplingParams(temperature=0.8, top_k=40, seed=5, logprobs=1),
        SamplingParams(temperature=1.1, min_p=0.05, seed=6, frequency_penalty=0.6),
        SamplingParams(temperature=0.0, logit_bias={17: 8.0}),
        SamplingParams(temperature=0.6, top_p=0.8, seed=7, min_tokens=2, stop_token_ids=[9]),
        SamplingParams(temperature=1.0, top_p=0.98, top_k=2000, seed=8, presence_penalty=-1.0),
    ]
    prompts = [[int(t) for t in torch.randint(0, vocab, (12,))] for _ in params]
    outputs = [[int(t) for t in torch.randint(0, vocab, (4,))] for _ in params]
    logits = torch.randn(len(params), vocab) * 2.5
    logits[:, EOS] += 5.0  # min_tokens must be what stops EOS

    state, rows = make_state(params, vocab, prompts, outputs)
    md = state.make_metadata(rows)
    batch_out = Sampler()(logits.clone(), md)
    batch_probs = Sampler().probs(logits, md)
    deterministic = [i for i, p in enumerate(params) if p.greedy or p.seed is not None]
    for i, p in enumerate(params):
        alone_state = SamplingState(1, vocab, "cpu")
        alone_state.add_request(0, p, prompts[i], outputs[i], EOS)
        alone_md = alone_state.make_metadata(np.array([0]))
        alone = Sampler()(logits[i : i + 1].clone(), alone_md)
        torch.testing.assert_close(Sampler().probs(logits[i : i + 1], alone_md)[0],
                                   batch_probs[i], rtol=1e-5, atol=1e-7)
        if i in deterministic:
            assert int(alone.sampled_token_ids[0]) == int(batch_out.sampled_token_ids[i]), i
        n = p.logprobs
        if n is None:
            continue
        if i in deterministic:
            torch.testing.assert_close(alone.logprobs.logprobs[0, : 1 + n],
                                       batch_out.logprobs.logprobs[i, : 1 + n])
            assert int(alone.logprobs.ranks[0]) == int(batch_out.logprobs.ranks[i])
        assert torch.equal(alone.logprobs.token_ids[0, 1 : 1 + n],
                           batch_out.logprobs.token_ids[i, 1 : 1 + n])
        torch.testing.assert_close(alone.logprobs.logprobs[0, 1 : 1 + n],
                                   batch_out.logprobs.logprobs[i, 1 : 1 + n])
    assert int(batch_out.sampled_token_ids[6]) not in (EOS, 9)


# ----------------------------------------------------------------- contracts
def test_row_contracts():
    state = SamplingState(2, 10, "cpu")
    state.add_request(0, SamplingParams(), [1], [], None)
    with pytest.raises(ValueError):
        state.add_request(0, SamplingParams(), [1], [], None)
    with pytest.raises(ValueError):
        state.make_metadata(np.array([0, 1]))
    md = state.make_metadata(np.array([0]))
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(1, 11), md)
    assert state.remove_request(0) is None
    assert state.num_active == 0
    state.add_request(0, SamplingParams(seed=3), [1], [], None)
    assert isinstance(state.remove_request(0), torch.Generator)


def test_empty_batch():
    state = SamplingState(2, 10, "cpu")
    md = state.make_metadata(np.array([], dtype=np.int64))
    out = Sampler()(torch.zeros(0, 10), md)
    assert out.sampled_token_ids.shape == (0,) and out.logprobs is None


# ----------------------------------------------------------------- greedy argmax
def test_greedy_argmax_matches_torch_ties_and_nan():
    """numpy's argmax (the CPU path) picks what torch.argmax picks: the lowest index
    among ties, NaN as the largest value, all -inf -> 0; also for a subset of rows."""
    from engine.sample.sampler import greedy_argmax

    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([
        [1.0, 3.0, 3.0, 0.0, 3.0],      # tie: 1
        [2.0, nan, 5.0, nan, 0.0],      # NaN: the first NaN
        [-inf, -inf, -inf, -inf, -inf],  # masked row: 0
        [0.0, inf, 1.0, inf, 2.0],      # +inf tie: 1
        [7.0, 7.0, 7.0, 7.0, 7.0],      # all equal: 0
        [0.0, 0.0, 0.0, 0.0, 9.0],
    ])
    expected = logits.argmax(dim=-1)
    assert greedy_argmax(logits).tolist() == expected.tolist() == [1, 1, 0, 1, 0, 4]
    rows = np.array([0, 1, 3, 5])
    assert greedy_argmax(logits, rows).tolist() == expected[rows].tolist()
    assert greedy_argmax(logits, np.zeros(0, np.int64)).tolist() == []
    big = torch.randn(37, 1000)
    big[:, 17] = big[:, 400] = big.max() + 1  # every row ties at 17 and 400
    assert greedy_argmax(big).tolist() == [17] * 37
    rows = np.array([0, 1, 2, 9, 11, 12, 36])
    random = torch.randn(37, 1000)
    assert greedy_argmax(random, rows).tolist() == random.argmax(dim=-1)[rows].tolist()
    assert greedy_argmax(random.to(torch.float64), rows).tolist() == \
        random.argmax(dim=-1)[rows].tolist()


def test_mixed_batch_reads_greedy_rows_only(monkeypatch):
    """In a greedy + random batch the argmax runs over the greedy rows only."""
    import engine.sample.sampler as sampler_module

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)]
    state, rows = make_state(params, 50)
    logits = torch.randn(4, 50)
    expected_greedy = logits.argmax(dim=-1)
    seen = []
    real = sampler_module.greedy_argmax

    def spy(x, greedy_rows=None):
        seen.append(None if greedy_rows is None else greedy_rows.tolist())
        return real(x, greedy_rows)

    monkeypatch.setattr(sampler_module, "greedy_argmax", spy)
    out = Sampler()(logits.clone(), state.make_metadata(rows)).sampled_token_ids
    assert seen == [[0, 2, 3]]
    assert out[[0, 2, 3]].tolist() == expected_greedy[[0, 2, 3]].tolist()
