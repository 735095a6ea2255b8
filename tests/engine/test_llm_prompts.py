"""LLM's prompt forms (engine/frontend/llm.py): text, token ids, and vLLM's dict spellings
{"prompt": text} and {"prompt_token_ids": ids} give the same greedy tokens; a dict with
neither key is a ValueError naming the keys it has."""

from __future__ import annotations

import pytest

from tests.support.model_fixtures import build_tiny_checkpoint


def test_dict_prompts_equal_their_plain_forms(tmp_path):
    from engine import LLM, SamplingParams

    llm = LLM(str(build_tiny_checkpoint(tmp_path / "tiny")), dtype="float32",
              max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    text = "hello world"
    ids = list(llm.tokenizer(text).input_ids)
    forms = [text, {"prompt": text}, ids, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert len(tokens[0]) == 6 and all(t == tokens[0] for t in tokens)
    assert [o.prompt_token_ids for o in outputs] == [ids] * 4
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"text": text}], params, use_tqdm=False)
    llm.shutdown()
