"""Structured outputs inside the engine: scheduler + grammar manager + sampler, driven
step by step with the tiny tokenizer, then one offline run of a tiny random model."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from engine.outputs import ModelRunnerOutput
from engine.request import EngineCoreRequest, RequestStatus
from engine.sample import Sampler, SamplingState
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.structured_output import StructuredOutputsParams
from tests.support.model_fixtures import build_tiny_checkpoint, build_tiny_tokenizer
from tests.support.scheduler import grammar_scheduler

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture
def scheduler(tokenizer):
    with grammar_scheduler(tokenizer, VOCAB) as s:
        yield s


def add(scheduler, req_id, tokenizer, kind=None, spec="", after_token_id=None, **params):
    structured = StructuredOutputsParams(kind, spec, after_token_id) if kind else None
    params.setdefault("max_tokens", 20)
    request = EngineCoreRequest(req_id, tokenizer("Answer:").input_ids,
                                SamplingParams(structured_outputs=structured, **params),
                                eos_token_id=tokenizer.eos_token_id)
    return scheduler.add_request(request)


def schedule_until_grammar(scheduler, deadline_s=30.0):
    """Schedule (and run nothing) until the constrained request is admitted."""
    end = time.monotonic() + deadline_s
    while scheduler.waiting_for_grammar:
        assert time.monotonic() < end, "the grammar never compiled"
        time.sleep(0.01)
        if scheduler.waiting_for_grammar:
            scheduler._admit_compiled()
    return scheduler.schedule()


def schedule_until_grammar_failure(scheduler, deadline_s=30.0):
    """Schedule until some grammar fails; its error outputs (empty on timeout)."""
    end = time.monotonic() + deadline_s
    failures = []
    while not failures and time.monotonic() < end:
        scheduler.schedule()
        failures = scheduler.take_grammar_failures()
        time.sleep(0.01)
    return failures


def allowed(bitmask_row: torch.Tensor) -> list[int]:
    bits = [(int(bitmask_row[t // 32]) >> (t % 32)) & 1 for t in range(VOCAB)]
    return [t for t, bit in enumerate(bits) if bit]


def feed(scheduler, output, tokens: dict[str, int]):
    req_ids = list(output.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                               [[tokens[r]] if r in tokens else [] for r in req_ids])
    return {o.req_id: o for o in scheduler.update_from_output(output, runner).outputs}


def test_mask_advance_and_finish(scheduler, tokenizer):
    constrained = add(scheduler, "c", tokenizer, "regex", "[0-9]{2}", temperature=0)
    free = add(scheduler, "f", tokenizer, temperature=0)
    assert constrained.status == RequestStatus.WAITING_FOR_GRAMMAR or constrained.grammar.matcher
    output = schedule_until_grammar(scheduler)
    if "c" not in output.num_scheduled_tokens:  # admitted after "f" was scheduled alone
        feed(scheduler, output, {"f": 300})
        output = scheduler.schedule()
    text = []
    for _ in range(3):
        assert output.grammar is not None and output.grammar.req_ids == ["c"]
        ids = allowed(output.grammar.bitmask[0])
        decoded = {tokenizer.decode([t]) for t in ids}
        if len(text) < 2:
            assert ids and all(re.fullmatch(r"[0-9]{1,2}", d) for d in decoded), decoded
            token = next(t for t in ids if len(tokenizer.decode([t])) == 1)
        else:
            assert ids == [tokenizer.eos_token_id]
            token = tokenizer.eos_token_id
        text.append(token)
        outputs = feed(scheduler, output, {"c": token, "f": 300})
        output = scheduler.schedule()
    assert outputs["c"].finish_reason == "stop" and "c" not in scheduler.requests
    assert re.fullmatch(r"[0-9]{2}", tokenizer.decode(text[:2]))
    assert free.grammar is None and output.grammar is None  # free requests pay nothing


def test_a_forbidden_token_ends_the_output(scheduler, tokenizer):
    add(scheduler, "c", tokenizer, "choice", json.dumps(["yes", "no"]))
    output = schedule_until_grammar(scheduler)
    forbidden = tokenizer("7").input_ids[0]
    assert forbidden not in allowed(output.grammar.bitmask[0])
    outputs = feed(scheduler, output, {"c": forbidden})
    assert outputs["c"].finish_reason == "stop" and outputs["c"].new_token_ids == []


def test_failed_compile_and_abort_while_compiling(scheduler, tokenizer):
    add(scheduler, "bad", tokenizer, "regex", "((")  # the frontend would have said 400
    add(scheduler, "gone", tokenizer, "json", json.dumps({"type": "object"}))
    scheduler.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    failures = schedule_until_grammar_failure(scheduler)
    [failure] = failures
    assert failure.req_id == "bad" and failure.finish_reason == "error"
    assert "invalid regex" in failure.error
    assert not scheduler.has_unfinished_requests() and not scheduler.requests


def test_a_stop_id_the_matcher_refuses_fails_only_its_request(scheduler, tokenizer):
    # The frontend refuses such ids with a 400; the core must not die if one slips by.
    add(scheduler, "bad", tokenizer, "json", "{}", stop_token_ids=[-6650])
    failures = schedule_until_grammar_failure(scheduler)
    [failure] = failures
    assert failure.req_id == "bad" and "grammar matcher" in failure.error
    assert not scheduler.has_unfinished_requests() and not scheduler.requests


def test_preempted_request_keeps_its_matcher(scheduler, tokenizer):
    """Preemption by recompute keeps the output tokens, so the matcher is still right:
    after four letters and a preemption, the recomputed request may only write digits."""
    request = add(scheduler, "c", tokenizer, "regex", "a{4}[0-9]{4}")
    output = schedule_until_grammar(scheduler)
    letter = tokenizer("a").input_ids[0]
    for _ in range(4):
        assert allowed(output.grammar.bitmask[0]) == [letter]
        feed(scheduler, output, {"c": letter})
        output = scheduler.schedule()
    scheduler.running.remove(request)
    scheduler._preempt(request)  # what running out of KV blocks does to the last request
    assert request.num_computed_tokens == 0 and request.status == RequestStatus.PREEMPTED
    output = scheduler.schedule()
    assert output.scheduled_cached_reqs.resumed_from_preemption == [True]
    digits = {tokenizer.decode([t]) for t in allowed(output.grammar.bitmask[0])}
    assert digits and all(re.fullmatch(r"[0-9]+", d) for d in digits), digits


def test_grammar_waits_for_the_end_of_reasoning(scheduler, tokenizer):
    """With after_token_id (a reasoning model's </think>), the output is free and the
    matcher idle until that token; from the next token on, the grammar holds."""
    end = tokenizer.eos_token_id + 1  # stands for </think>
    request = add(scheduler, "c", tokenizer, "regex", "[0-9]{2}", after_token_id=end)
    output = schedule_until_grammar(scheduler)
    free_word = tokenizer("hmm").input_ids[0]
    for token in (free_word, free_word, end):
        assert output.grammar is None  # thinking: no mask
        feed(scheduler, output, {"c": token})
        output = scheduler.schedule()
    digits = {tokenizer.decode([t]) for t in allowed(output.grammar.bitmask[0])}
    assert digits and all(re.fullmatch(r"[0-9]+", d) for d in digits)
    assert request.output_token_ids == [free_word, free_word, end]


def test_grammar_after_reasoning_only_when_the_prompt_has_not_closed_thinking():
    from server.chat.reasoning import grammar_after_reasoning

    class Tokenizer:
        unk_token_id = None

        def convert_tokens_to_ids(self, token):
            return 77 if token == "</think>" else None

    params = StructuredOutputsParams("json_object")
    assert grammar_after_reasoning(Tokenizer(), "qwen3", params, [1, 2]).after_token_id == 77
    # enable_thinking false: the template already closed an empty think block.
    assert grammar_after_reasoning(Tokenizer(), "qwen3", params, [1, 77, 2]) is params


def test_sampler_masks_only_constrained_rows():
    state = SamplingState(4, VOCAB)
    for row in range(3):
        state.add_request(row, SamplingParams(temperature=0), [1], [], None)
    metadata = state.make_metadata([0, 1, 2])
    logits = torch.randn(3, VOCAB)
    free_best = logits.argmax(dim=-1)
    bitmask = torch.zeros(1, VOCAB // 32, dtype=torch.int32)
    bitmask[0, 5] = 1 << 3  # token 163 only
    metadata.grammar_rows, metadata.grammar_bitmask = [1], bitmask
    sampled = Sampler()(logits.clone(), metadata).sampled_token_ids
    assert sampled[1] == 163
    assert sampled[0] == free_best[0] and sampled[2] == free_best[2]


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams("json_object"))
    assert info.value.param == "min_tokens"


def test_offline_tiny_model_batch(tmp_path):
    """A constrained and a free greedy request in one batch: the constrained output
    matches its regex, the free one is what it is alone."""
    from engine.frontend.llm import LLM

    llm = LLM(str(build_tiny_checkpoint(tmp_path / "llama")), dtype="float32",
              max_model_len=128, kv_cache_memory="4M", device="cpu", max_num_seqs=4,
              max_num_batched_tokens=64)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    regex = r"(yes|no): [a-z]{3,8}\."
    constrained = SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams("regex", regex))
    alone = llm.generate(["The quick brown fox"], free, use_tqdm=False)[0].outputs[0].text
    both = llm.generate(["The quick brown fox", "Hello"], [free, constrained], use_tqdm=False)
    assert both[0].outputs[0].text == alone
    assert re.fullmatch(regex, both[1].outputs[0].text), both[1].outputs[0].text
    assert both[1].outputs[0].finish_reason == "stop"
