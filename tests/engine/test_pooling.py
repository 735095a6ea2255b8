"""Pooling requests (embeddings) on the engine: a decoder's hidden states pooled against
transformers' on the same weights, mixed with generating requests in the same steps,
with no block left held and the generated tokens unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.pooling_params import PoolingParams, PoolingParamsError
from engine.request import EngineCoreRequest
from engine.xray_schema import XrayLimits
from tests.support.hf_reference import load_hf_model
from tests.support.model_fixtures import build_tiny_checkpoint

PROMPTS = [[5, 9, 14, 3, 77], [8], list(range(3, 60)), [11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama",
                                 max_position_embeddings=256)


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(str(model_dir), dtype="float32", max_model_len=256, async_scheduling=False)
    yield engine
    engine.shutdown()


def hf_hidden_states(model_dir, prompt: list[int]) -> torch.Tensor:
    model = load_hf_model(model_dir)
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()  # after the final norm: [tokens, hidden]


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_pooled_vectors_match_transformers(llm, model_dir, pooling_type):
    params = PoolingParams(pooling_type, normalize=False)
    outputs = llm.embed(PROMPTS, params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        hidden = hf_hidden_states(model_dir, prompt)
        expected = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]
        ours = torch.tensor(output.pooled)
        assert ours.shape == expected.shape
        torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
        assert output.outputs[0].token_ids == []  # nothing sampled
    assert llm.engine_core.scheduler.kv_cache_manager.usage == 0.0


def test_normalize_and_dimensions(llm):
    full = llm.embed(PROMPTS[:1], PoolingParams("mean", normalize=False), use_tqdm=False)
    cut = llm.embed(PROMPTS[:1], PoolingParams("mean", normalize=True, dimensions=8),
                    use_tqdm=False)
    vector = np.asarray(cut[0].pooled)
    assert vector.shape == (8,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-6)
    head = np.asarray(full[0].pooled[:8])
    np.testing.assert_allclose(vector, head / np.linalg.norm(head), atol=1e-6)
    with pytest.raises(PoolingParamsError):
        PoolingParams("max")


def test_pooling_beside_generation_in_the_same_steps(llm):
    """Pooling requests scheduled in the steps of generating ones: each side gets what
    it gets alone, and the pooling ones finish in the step that computed them."""
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    alone_tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy,
                                                                  use_tqdm=False)]
    params = PoolingParams("last", normalize=False)
    alone_vectors = [o.pooled for o in llm.embed(PROMPTS[2:], params, use_tqdm=False)]
    core = llm.engine_core
    for i, prompt in enumerate(PROMPTS[:2]):
        core.add_request(EngineCoreRequest(f"g{i}", prompt, greedy))
    core.step()  # the generating ones are now running (decoding next)
    pool_params = SamplingParams(max_tokens=1, temperature=0)
    for i, prompt in enumerate(PROMPTS[2:]):
        core.add_request(EngineCoreRequest(f"p{i}", prompt, pool_params, pooling_params=params))
    tokens: dict[str, list[int]] = {"g0": [], "g1": []}
    vectors: dict[str, list[float]] = {}
    first_step = None
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        for out in core.step().outputs:
            if out.pooled is not None:
                vectors[out.req_id] = out.pooled
                assert out.finish_reason == "stop" and out.new_token_ids == []
                first_step = first_step or steps
            else:
                tokens[out.req_id].extend(out.new_token_ids)
    assert first_step == 1  # both pooled in the first step after they arrived
    assert [tokens["g0"], tokens["g1"]] == [alone_tokens[0][1:], alone_tokens[1][1:]]
    for i, vector in enumerate(alone_vectors):
        torch.testing.assert_close(torch.tensor(vectors[f"p{i}"]), torch.tensor(vector),
                                   atol=1e-5, rtol=1e-5)
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_a_pooling_prompt_may_fill_the_context_but_not_pass_it(llm):
    full = list(range(3, 3 + 256))
    assert len(llm.embed([full], use_tqdm=False)[0].pooled) > 0
    with pytest.raises(ValueError, match="maximum context length"):
        llm.embed([full + [5]], use_tqdm=False)


def test_the_xray_marks_pooling_requests(llm):
    core = llm.engine_core
    core.add_request(EngineCoreRequest("pool", PROMPTS[0], SamplingParams(max_tokens=1),
                                       pooling_params=PoolingParams()))
    core.add_request(EngineCoreRequest("gen", PROMPTS[1], SamplingParams(max_tokens=2)))
    snapshot = core.xray_snapshot(XrayLimits())
    listed = {r.req_id: r.pooling for r in [*snapshot.running, *snapshot.waiting]}
    assert listed == {"pool": True, "gen": False}
    while core.has_unfinished_requests():
        core.step()


def test_a_pooling_runners_context_is_capped_at_the_step_token_budget(model_dir):
    """A decoder under --runner pooling computes each input in one step: its context is
    capped at the step's token budget, so a longer input is refused as past the context."""
    engine = LLM(str(model_dir), dtype="float32", max_model_len=256, runner="pooling",
                 max_num_batched_tokens=32, async_scheduling=False)
    try:
        assert engine.max_model_len == 32
        assert len(engine.embed([list(range(3, 35))], use_tqdm=False)[0].pooled) > 0
        with pytest.raises(ValueError, match="maximum context length"):
            engine.embed([list(range(3, 36))], use_tqdm=False)
    finally:
        engine.shutdown()
