"""llama.cpp LoRA GGUFs (engine/lora/gguf_adapter.py) on a GGUF base, as users get both:
tests/data/gguf/tiny-llama-lora-b8-F16.gguf is llama.cpp's convert_lora_to_gguf.py
output of the PEFT adapter beside it (tests/data/gguf/make_lora_fixture.py). Its weights
are the PEFT adapter's (q/k rows un-permuted), and greedy tokens under it match
transformers + peft applying the PEFT adapter on the same base file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from engine import LLM, SamplingParams
from engine.lora.checkpoint import AdapterError, check_adapter, read_adapter
from engine.lora_request import LoRARequest
from engine.model_loader.gguf import ensure_converted
from tests.support.hf_reference import assert_greedy_matches
from tests.support.lora_fixtures import peft_greedy_reference

FIXTURES = Path(__file__).parents[1] / "data" / "gguf"
BASE = FIXTURES / "tiny-llama-Q8_0.gguf"
GGUF_ADAPTER = FIXTURES / "tiny-llama-lora-b8-F16.gguf"
PEFT_ADAPTER = FIXTURES / "tiny-llama-lora-b8"
PROMPTS = [[(7 * i + 3) % 380 + 10 for i in range(30)], [5, 6, 7, 8], list(range(40, 90))]
NUM_NEW = 10


@pytest.fixture(scope="module")
def base_config():
    return AutoConfig.from_pretrained(ensure_converted(BASE)).get_text_config()


def test_the_gguf_adapter_holds_the_peft_adapters_weights(base_config):
    gguf = check_adapter(str(GGUF_ADAPTER), base_config, max_rank=8)
    peft = check_adapter(str(PEFT_ADAPTER), base_config, max_rank=8)
    assert (gguf.rank, gguf.scale) == (peft.rank, peft.scale) == (8, 2.0)
    ours = read_adapter(gguf, base_config, torch.float32, torch.device("cpu"))
    want = read_adapter(peft, base_config, torch.float32, torch.device("cpu"))
    assert set(ours) == set(want) and len(ours) == 2 * 7  # 2 layers x 7 linears
    for module, (a, b) in want.items():
        # F16 in the file: within half a unit of its last place (q/k rows in HF's order).
        torch.testing.assert_close(ours[module][0], a, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(ours[module][1], b, rtol=1e-3, atol=1e-4)


def test_greedy_tokens_under_the_gguf_adapter_match_peft():
    reference = peft_greedy_reference(ensure_converted(BASE), PEFT_ADAPTER, PROMPTS, NUM_NEW)
    base_only = peft_greedy_reference(ensure_converted(BASE), None, PROMPTS, NUM_NEW)
    llm = LLM(str(BASE), dtype="float32", max_model_len=128, enable_lora=True, max_loras=2,
              max_lora_rank=8)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    gguf = LoRARequest("gguf", 1, str(GGUF_ADAPTER))
    outs = llm.generate(PROMPTS * 2, params, use_tqdm=False,
                        lora_request=[gguf] * len(PROMPTS) + [None] * len(PROMPTS))
    tokens = [o.outputs[0].token_ids for o in outs]
    assert_greedy_matches(tokens[:len(PROMPTS)], reference)
    assert_greedy_matches(tokens[len(PROMPTS):], base_only)
    assert tokens[:len(PROMPTS)] != tokens[len(PROMPTS):]  # the adapter changes the answers


def test_a_model_gguf_or_an_adapter_over_the_rank_limit_is_refused(base_config):
    with pytest.raises(AdapterError, match="not a LoRA adapter"):
        check_adapter(str(BASE), base_config, max_rank=8)
    with pytest.raises(AdapterError, match="rank 8 is over --max-lora-rank 4"):
        check_adapter(str(GGUF_ADAPTER), base_config, max_rank=4)
