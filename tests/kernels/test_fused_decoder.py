"""The fused decoder stack (engine.models.fused_decoder) against the Python layers.

The stack runs the same kernels on the same tensors as the modules, so a whole
generation with it must give the modules' tokens and their logprobs bit for bit, while
its steps interleave with the modules' (prefill steps that need SDPA run the modules).
Parity with `transformers` is test_correctness's, which runs the stack by default.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.lora_request import LoRARequest
from engine.models.fused_decoder import STEPS_RUN
from engine.models.quant import KERNEL_CALLS
from pagedserve_kernels.cpu_kernels import cpu_kernels
from tests.support.lora_fixtures import build_adapter
from tests.support.model_fixtures import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="C++ CPU kernels unavailable")

# Long prompts (> the kernel's 64-token chunks) prefill through SDPA and the modules;
# with a 96-token step budget the 200-token one is chunked across steps that also decode.
PROMPT_LENS = [3, 200, 30, 70, 9]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)


def generate(model_dir, monkeypatch, fused: bool, **engine_kwargs):
    monkeypatch.setenv("PAGEDSERVE_FUSED_DECODER", "1" if fused else "0")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 400, size=n).tolist() for n in PROMPT_LENS]
    prompts.append(prompts[1][:150] + [7, 8, 9])  # a prefix-cache hit on the chunked one
    llm = LLM(str(model_dir), max_num_batched_tokens=96, kv_cache_memory="4MB", **engine_kwargs)
    before, int4_calls = dict(STEPS_RUN), KERNEL_CALLS["int4"]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    steps = {path: STEPS_RUN[path] - before.get(path, 0) for path in ("fused", "modules")}
    steps["int4_calls"] = KERNEL_CALLS["int4"] - int4_calls
    tokens = [out.outputs[0].token_ids for out in outputs]
    logprobs = [(out.outputs[0].logprobs.token_ids, out.outputs[0].logprobs.logprobs)
                for out in outputs]
    return tokens, logprobs, steps


@pytest.mark.parametrize(("arch", "engine_kwargs"), [
    ("llama", {}),
    ("llama", {"quantization": "int4", "kv_cache_dtype": "bfloat16"}),
    ("llama", {"kv_cache_dtype": "int8"}),
    ("qwen3", {"dtype": "bfloat16", "kv_cache_dtype": "int8"}),
    ("qwen2", {"quantization": "int8"}),  # qkv bias
    ("llama", {"dtype": "bfloat16", "quantization": "int4"}),  # widened around the kernels
    ("qwen2", {"dtype": "bfloat16"}),
    ("qwen3", {}),  # per-head q/k RMSNorm
    ("qwen3", {"dtype": "bfloat16", "quantization": "int8"}),
])
def test_fused_stack_gives_the_modules_tokens_and_logprobs(tmp_path, monkeypatch, arch,
                                                           engine_kwargs):
    model_dir = build_tiny_checkpoint(tmp_path, arch, max_position_embeddings=512)
    tokens, logprobs, steps = generate(model_dir, monkeypatch, True, **engine_kwargs)
    ref_tokens, ref_logprobs, ref_steps = generate(model_dir, monkeypatch, False,
                                                   **engine_kwargs)
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs
    assert ref_steps["fused"] == 0
    # Both paths ran: the decode steps fused, the SDPA prefills through the modules.
    assert steps["fused"] >= PARAMS.max_tokens - 1 and steps["modules"] >= 2
    # The stack counts the quantized kernels' calls as the modules do.
    assert steps["int4_calls"] == ref_steps["int4_calls"]
    assert (steps["int4_calls"] > 0) == (engine_kwargs.get("quantization") == "int4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_stack_runs_lora_adapters_as_the_modules_do(tmp_path, monkeypatch, dtype):
    """Adapters with different target modules and the base in one batch: the stack's
    side paths give the modules' tokens and logprobs bit for bit."""
    base = build_tiny_checkpoint(tmp_path / "base", "llama", max_position_embeddings=512)
    requests = [LoRARequest(name, i + 1, str(build_adapter(base, tmp_path, name, seed=i)))
                for i, name in enumerate(("a4", "c16"))]

    def run(fused: bool):
        monkeypatch.setenv("PAGEDSERVE_FUSED_DECODER", "1" if fused else "0")
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 400, size=n).tolist() for n in PROMPT_LENS]
        llm = LLM(str(base), dtype=dtype, max_num_batched_tokens=96, kv_cache_memory="4MB",
                  enable_lora=True, max_loras=2)
        before = STEPS_RUN["fused"]
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False,
                               lora_request=[requests[0], requests[1], None, requests[1],
                                             requests[0]])
        return ([(o.outputs[0].token_ids, o.outputs[0].logprobs.logprobs) for o in outputs],
                STEPS_RUN["fused"] - before)

    (fused_out, fused_steps), (modules_out, modules_steps) = run(True), run(False)
    assert fused_out == modules_out
    assert fused_steps >= PARAMS.max_tokens - 1 and modules_steps == 0


def test_models_the_stack_does_not_cover_run_the_modules(tmp_path, monkeypatch):
    model_dir = build_tiny_checkpoint(tmp_path, "qwen3_moe", max_position_embeddings=512)
    _, _, steps = generate(model_dir, monkeypatch, True)  # experts, not a GatedMLP
    assert steps["fused"] == 0 and steps["modules"] > 0


@pytest.mark.parametrize("name", ["tiny-llama-Q4_K_M.gguf", "tiny-qwen3-Q4_K_M.gguf",
                                  "tiny-llama-i320-Q4_K_M.gguf", "tiny-llama-Q5_K_M.gguf"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_stack_serves_gguf_blocks_as_the_modules_do(monkeypatch, name, dtype):
    """GGUF K-quant weights (Q4_K / Q6_K repacked into blocked int4 / int8, a stacked qkv of
    Q4_K + Q6_K pieces, Q5_0/Q8_0 repacks, Q5_K as int8 with mins) in the stack: the modules' tokens
    and logprobs, bit for bit, with as many kernel calls of each kind."""
    path = Path(__file__).parents[1] / "data" / "gguf" / name
    before = Counter(KERNEL_CALLS)
    tokens, logprobs, steps = generate(path, monkeypatch, True, dtype=dtype)
    fused_calls = Counter(KERNEL_CALLS) - before
    ref_tokens, ref_logprobs, ref_steps = generate(path, monkeypatch, False, dtype=dtype)
    modules_calls = Counter(KERNEL_CALLS) - before - fused_calls
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs
    assert steps["fused"] >= PARAMS.max_tokens - 1 and ref_steps["fused"] == 0
    for kind in ("int4", "int8", "Q5_K"):  # Q4_K repacked: int4; Q6_K: int8
        assert fused_calls[kind] == modules_calls[kind], kind
    assert fused_calls["int8" if "Q5_K" in name else "int4"] > 0
    assert fused_calls["Q5_K"] == 0  # repacked, never the file's own blocks
