"""Speculative decoding with structured outputs: a constrained request's drafts are cut
where its grammar refuses them, each verified position gets its own mask, and greedy
outputs equal one-token-at-a-time decoding.

First the scheduler alone (the tiny tokenizer, a fake verifying runner), then a tiny
random model with the real n-gram proposer on prompts that hold the text to write.
"""

from __future__ import annotations

import json
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from engine.outputs import ModelRunnerOutput
from engine.request import EngineCoreRequest
from engine.sched.output import GrammarBitmask
from engine.structured_output import StructuredOutputsParams
from engine.worker.model_runner import ModelRunner
from tests.support.model_fixtures import build_tiny_checkpoint, build_tiny_tokenizer
from tests.support.scheduler import grammar_scheduler
from tests.support.spec_decode import SpecCounts, assert_all_blocks_free

VOCAB = 512
K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}


# ------------------------------------------------------------------ the scheduler alone
@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def scheduler(tokenizer):
    with grammar_scheduler(tokenizer, VOCAB, SpeculativeConfig(num_speculative_tokens=K)) as s:
        yield s


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def start(scheduler, tokenizer, kind, spec, *, after_token_id=None, **params):
    """Add a constrained request "c" and wait until its grammar is compiled."""
    structured = StructuredOutputsParams(kind, spec, after_token_id)
    request = scheduler.add_request(EngineCoreRequest(
        "c", ids(tokenizer, "Answer:"),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=structured, **params),
        eos_token_id=tokenizer.eos_token_id))
    end = time.monotonic() + 30
    while scheduler.waiting_for_grammar:
        assert time.monotonic() < end, "the grammar never compiled"
        time.sleep(0.01)
        scheduler._admit_compiled()
    return request


def run_step(scheduler, tokens: list[int]):
    """Schedule one step and let the fake runner emit `tokens` for request "c"."""
    out = scheduler.schedule()
    runner = ModelRunnerOutput(["c"], {"c": 0}, [tokens])
    return out, scheduler.update_from_output(out, runner).outputs


def propose_always(scheduler, draft: list[int]) -> None:
    scheduler.speculator.propose = lambda request, max_drafts: list(draft[:max_drafts])


def allowed(row: torch.Tensor) -> set[int]:
    return {t for t in range(VOCAB) if (int(row[t // 32]) >> (t % 32)) & 1}


def masks_one_at_a_time(scheduler, request, draft: list[int]) -> list[set[int]]:
    """What one-token-at-a-time decoding would mask before each of draft's tokens and
    after the last: a fresh matcher fed the request's output, then the draft."""
    grammar = scheduler.structured_output.submit(request.grammar.params,
                                                 request.grammar.stop_token_ids)
    assert scheduler.structured_output.poll(grammar) and grammar.error is None
    for token_id in request.output_token_ids:
        assert grammar.accept(token_id)
    masks = []
    for token_id in [*draft, None]:
        masks.append(allowed(scheduler.structured_output.fill_bitmask([grammar])[0]))
        if token_id is not None:
            assert grammar.accept(token_id)
    return masks


def test_a_draft_is_cut_before_the_token_the_grammar_refuses(scheduler, tokenizer):
    request = start(scheduler, tokenizer, "regex", "[0-9]{6}")
    digit = ids(tokenizer, "1")
    assert len(digit) == 1
    run_step(scheduler, digit)  # the prefill samples "1"
    # "2", "3", then "x" (refused), then "4": cut to ["2", "3"].
    two, three, letter, four = (ids(tokenizer, c)[0] for c in "23x4")
    propose_always(scheduler, [two, three, letter, four])
    before = allowed(scheduler.structured_output.fill_bitmask([request.grammar])[0])
    out = scheduler.schedule()
    assert out.scheduled_spec_decode_tokens == {"c": [two, three]}
    assert out.num_scheduled_tokens == {"c": 3}
    # One mask row per verified position, each as one-token-at-a-time decoding has it.
    assert out.grammar.req_ids == ["c"] and out.grammar.num_rows == [3]
    got = [allowed(row) for row in out.grammar.bitmask]
    assert got == masks_one_at_a_time(scheduler, request, [two, three])
    assert letter not in got[2] and four in got[2]
    # The matcher was rolled back: its next mask is what it was before the step.
    assert allowed(scheduler.structured_output.fill_bitmask([request.grammar])[0]) == before
    assert got[0] == before
    # The model accepts "2", rejects "3" and says "5": the matcher takes both tokens.
    five = ids(tokenizer, "5")[0]
    outputs = scheduler.update_from_output(
        out, ModelRunnerOutput(["c"], {"c": 0}, [[two, five]])).outputs
    assert outputs[0].new_token_ids == [two, five]
    assert request.num_computed_tokens == request.num_tokens - 1  # "3" rolled back
    assert tokenizer.decode(request.output_token_ids) == "125"
    # Three digits remain: a fourth is refused (only EOS may follow).
    propose_always(scheduler, [four, four, four, four])
    out, outputs = run_step(scheduler, [four, four, four, tokenizer.eos_token_id])
    assert out.scheduled_spec_decode_tokens == {"c": [four, four, four]}
    assert out.grammar.num_rows == [4]
    assert allowed(out.grammar.bitmask[3]) == {tokenizer.eos_token_id}
    assert outputs[0].finish_reason == "stop" and "c" not in scheduler.requests
    assert tokenizer.decode(outputs[0].new_token_ids, skip_special_tokens=True) == "444"
    manager = scheduler.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.num_blocks


def test_a_stop_token_that_completes_the_output_is_left_to_the_last_row(scheduler, tokenizer):
    request = start(scheduler, tokenizer, "choice", json.dumps(["yes", "no"]))
    yes = ids(tokenizer, "yes")
    eos = tokenizer.eos_token_id
    run_step(scheduler, yes[:1])
    propose_always(scheduler, [*yes[1:], eos, eos])
    out = scheduler.schedule()
    # EOS would end the output (no mask after it): the draft stops before it.
    assert out.scheduled_spec_decode_tokens.get("c", []) == yes[1:]
    assert allowed(out.grammar.bitmask[-1]) == {eos}
    assert request.grammar.matcher.is_terminated() is False


def test_a_token_the_grammar_refuses_among_several_ends_the_output(scheduler, tokenizer):
    """As with one token a step: a refused token (the masks make it impossible; a
    runner bug would) ends the output cleanly before it, and the blocks come back."""
    start(scheduler, tokenizer, "regex", "[0-9]{6}")
    one, letter = ids(tokenizer, "1")[0], ids(tokenizer, "x")[0]
    run_step(scheduler, [one])
    propose_always(scheduler, [one, one])
    out, outputs = run_step(scheduler, [one, one, letter])
    assert out.scheduled_spec_decode_tokens == {"c": [one, one]}
    assert outputs[0].new_token_ids == [one, one] and outputs[0].finish_reason == "stop"
    manager = scheduler.kv_cache_manager
    assert manager.block_pool.get_num_free_blocks() == manager.num_blocks


def test_free_reasoning_drafts_stop_before_the_grammar_starts(scheduler, tokenizer):
    end = tokenizer.eos_token_id + 1  # stands for </think>
    request = start(scheduler, tokenizer, "regex", "[0-9]{2}", after_token_id=end)
    word = ids(tokenizer, "hmm")[0]
    run_step(scheduler, [word])
    propose_always(scheduler, [word, word, end, word])
    out, _ = run_step(scheduler, [word, word, end])
    # The row after </think> needs the grammar's first mask: the draft stops before it.
    assert out.scheduled_spec_decode_tokens == {"c": [word, word]}
    assert out.grammar is None  # thinking: no mask
    assert request.grammar.active
    propose_always(scheduler, [])
    out, _ = run_step(scheduler, [ids(tokenizer, "4")[0]])
    assert out.grammar is not None and out.grammar.num_rows is None  # one row, no drafts


def test_runner_points_each_request_at_its_mask_rows():
    """ModelRunner._set_grammar_rows on GrammarBitmask's worked example."""
    drafts = SimpleNamespace(num_rows=np.array([3, 1, 2]), starts=np.array([0, 3, 4]))
    inputs = SimpleNamespace(req_ids=["a", "b", "c"], sample_req_indices=np.arange(3),
                             drafts=drafts)
    bitmask = torch.arange(5, dtype=torch.int32).unsqueeze(1)  # row r holds r
    metadata = SimpleNamespace(grammar_rows=None, grammar_bitmask=None)
    grammar = GrammarBitmask(["c", "a"], bitmask, num_rows=[2, 3])
    ModelRunner._set_grammar_rows(metadata, grammar, inputs)
    assert metadata.grammar_rows == [4, 5, 0, 1, 2]
    assert metadata.grammar_bitmask[:, 0].tolist() == [0, 1, 2, 3, 4]
    # A constrained request without drafts in a step with drafts: one row, no num_rows.
    grammar = GrammarBitmask(["b"], bitmask[:1])
    ModelRunner._set_grammar_rows(metadata, grammar, inputs)
    assert metadata.grammar_rows == [3] and metadata.grammar_bitmask[:, 0].tolist() == [0]
    with pytest.raises(ValueError, match="logits rows"):
        ModelRunner._set_grammar_rows(
            metadata, GrammarBitmask(["a"], bitmask[:2], num_rows=[2]), inputs)


def test_mask_rows_travel_to_worker_ranks():
    """Tensor parallelism: a step's per-position mask rows reach every rank intact."""
    from engine.executor.messages import Step, core_side_codec, worker_side_codec
    from engine.sched.output import CachedRequestData, SchedulerOutput

    grammar = GrammarBitmask(["b"], torch.arange(6, dtype=torch.int32).reshape(3, 2),
                             num_rows=[3])
    output = SchedulerOutput([], CachedRequestData(["b"], [False], [[3]], [7]), {"b": 3}, 3,
                             grammar=grammar, scheduled_spec_decode_tokens={"b": [4, 5]})
    decoded = worker_side_codec().decode(core_side_codec().encode(Step(output)))
    got = decoded.scheduler_output.grammar
    assert got.req_ids == ["b"] and got.num_rows == [3]
    assert torch.equal(got.bitmask, grammar.bitmask)


# ------------------------------------------------------------------ a tiny model
SCHEMA = {"type": "object", "properties": {
    "animal": {"enum": ["quick brown fox", "lazy dog", "paged KV cache"]},
    "says": {"enum": ["Hello, world!", "How are you today?", "I am fine, thank you."]},
    "blocks": {"type": "boolean"}}, "required": ["animal", "says", "blocks"]}
JSON_TEXT = '{"animal": "lazy dog", "says": "How are you today?", "blocks": true}'
REGEX = r"(The quick brown fox jumps over the lazy dog\. ){1,3}[a-z]{1,8}\."
CHOICES = ["A paged KV cache stores keys", "A paged KV cache stores values in fixed-size "
           "blocks", "Hello, world! How are you today?"]
CASES = [  # (kind, spec, prompt text: what the output may copy)
    ("json", json.dumps(SCHEMA), f"Write JSON like {JSON_TEXT} or {JSON_TEXT} again."),
    ("regex", REGEX, "The quick brown fox jumps over the lazy dog. The quick brown fox "
                     "jumps over the lazy dog."),
    ("choice", json.dumps(CHOICES), "A paged KV cache stores keys and values in fixed-size "
                                    "blocks. Hello, world! How are you today?"),
]


def valid(kind: str, spec: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        props = SCHEMA["properties"]
        return (set(value) == set(props) and value["animal"] in props["animal"]["enum"]
                and value["says"] in props["says"]["enum"] and value["blocks"] in (True, False))
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return text in json.loads(spec)


class DraftCounts(SpecCounts):
    """`SpecCounts` plus the drafts the proposer made and those the scheduler cut,
    counted here (the grammar refused a token: the KV cache here is ample, so nothing is
    cut for lack of blocks)."""

    def __init__(self, llm: LLM):
        super().__init__(llm)
        self.proposed = self.cut = self.cut_tokens = 0
        scheduler = llm.engine_core.scheduler
        propose, schedule = scheduler.speculator.propose, scheduler.schedule
        last: dict[str, int] = {}

        def counted_propose(request, max_drafts):
            draft = propose(request, max_drafts)
            last[request.req_id] = len(draft)
            self.proposed += len(draft)
            return draft

        def counted_schedule():
            last.clear()
            output = schedule()
            for req_id, num in last.items():
                num_kept = len(output.scheduled_spec_decode_tokens.get(req_id, ()))
                self.cut += num_kept < num
                self.cut_tokens += num - num_kept
            return output

        scheduler.speculator.propose, scheduler.schedule = counted_propose, counted_schedule


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    model = build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama",
                                  max_position_embeddings=512)
    settings = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=128)
    return LLM(str(model), **settings), LLM(str(model), speculative_config=SPEC, **settings)


def constrained(kind: str, spec: str, **params) -> SamplingParams:
    params.setdefault("max_tokens", 120)
    return SamplingParams(structured_outputs=StructuredOutputsParams(kind, spec), **params)


def test_greedy_constrained_outputs_with_ngram_drafts_equal_plain(engines, tokenizer):
    plain, llm = engines
    prompts = [ids(tokenizer, prompt) for _, _, prompt in CASES]
    # Logprobs are of the masked distribution: equal only if each row had its own mask.
    params = [constrained(kind, spec, temperature=0.0, logprobs=1) for kind, spec, _ in CASES]
    want = plain.generate(prompts, params, use_tqdm=False)
    counts = DraftCounts(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    for (kind, spec, _), w, g in zip(CASES, want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, kind
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason == "stop"
        assert valid(kind, spec, g.outputs[0].text), g.outputs[0].text
        np.testing.assert_allclose([lp.logprob for lp in g.outputs[0].logprobs],
                                   [lp.logprob for lp in w.outputs[0].logprobs], atol=1e-4)
    assert counts.proposed > 0 and counts.cut > 0
    assert counts.grammar_cut_tokens == counts.cut_tokens > 0  # the engine's own count
    assert 0 < counts.accepted < counts.draft_tokens
    assert_all_blocks_free(llm)


def test_sampled_constrained_outputs_with_drafts_stay_valid(engines, tokenizer):
    _, llm = engines
    prompts = [ids(tokenizer, prompt) for _, _, prompt in CASES]
    counts = DraftCounts(llm)
    # Room for a random model's choice of short tokens (the regex may take 140 chars).
    outputs = llm.generate(prompts, [constrained(kind, spec, temperature=0.8, n=3, seed=5,
                                                 max_tokens=200)
                                     for kind, spec, _ in CASES], use_tqdm=False)
    for (kind, spec, _), output in zip(CASES, outputs, strict=True):
        for sequence in output.outputs:
            assert sequence.finish_reason == "stop", (kind, sequence.text)
            assert valid(kind, spec, sequence.text), (kind, sequence.text)
    assert counts.accepted > 0
    assert_all_blocks_free(llm)
