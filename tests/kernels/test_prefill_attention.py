"""The AVX512-BF16 prefill attention kernel (pagedserve_kernels/cpu/prefill_attention.cpp)
against a float64 causal softmax, beside torch's own bfloat16 flash kernel; the backend
takes it for long bfloat16 chunks; a bfloat16 model's greedy tokens over long chunked
prompts still match transformers (near-tie rule).

Skipped where the build has no AVX512-BF16 code (the backend keeps torch's kernel there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.backends import torch_backend
from pagedserve_kernels.cpu_kernels import prefill_attention_kernel

pytestmark = pytest.mark.skipif(prefill_attention_kernel() is None,
                                reason="no AVX512-BF16 prefill attention in this build")


def causal_reference(q, k, v, scale):
    """float64 softmax attention of the last L of S positions: q [L, Hq, D], k/v [Hkv, S, D]."""
    query_len, num_heads, _ = q.shape
    num_kv_heads, seq_len, _ = k.shape
    group = num_heads // num_kv_heads
    qd = q.double().transpose(0, 1)
    kd = k.double().repeat_interleave(group, 0)
    vd = v.double().repeat_interleave(group, 0)
    scores = qd @ kd.transpose(1, 2) * scale
    positions = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > positions, float("-inf"))
    return (torch.softmax(scores, -1) @ vd).transpose(0, 1)


def torch_flash(q, k, v, scale):
    """torch's bfloat16 SDPA on the same problem (its CPU flash kernel)."""
    query_len, seq_len = q.shape[0], k.shape[1]
    group = q.shape[1] // k.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - query_len, seq_len)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.repeat_interleave(group, 0)[None],
        v.repeat_interleave(group, 0)[None], attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


# (L, S, Hq, Hkv, D): a single token, chunks shorter and longer than a 32-key block and
# than a 32-position work item, L < S (a chunk after cached context), MHA and GQA groups
# of 3 and 4, every head size.
SHAPES = [(1, 1, 4, 1, 64), (5, 5, 4, 2, 64), (37, 100, 8, 2, 64), (70, 70, 3, 1, 64),
          (100, 260, 4, 4, 128), (33, 40, 2, 1, 256), (129, 129, 32, 8, 64), (64, 97, 6, 2, 128)]


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_reference(shape):
    query_len, seq_len, num_heads, num_kv_heads, head_size = shape
    gen = torch.Generator().manual_seed(sum(shape))
    q = torch.randn(query_len, num_heads, head_size, generator=gen).bfloat16()
    k = torch.randn(num_kv_heads, seq_len, head_size, generator=gen).bfloat16()
    v = torch.randn(num_kv_heads, seq_len, head_size, generator=gen).bfloat16()
    scale = head_size ** -0.5
    out = torch.full_like(q, float("nan"))
    prefill_attention_kernel()(out, q, k, v, scale)
    want = causal_reference(q, k, v, scale)
    ours = (out.double() - want).abs().max().item()
    theirs = (torch_flash(q, k, v, scale).double() - want).abs().max().item()
    # torch's error is the output's bf16 rounding; ours adds the weights' (one bf16 step).
    assert ours <= 2 * theirs + 2e-3, (ours, theirs)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_running_max_rises_block_after_block_and_strided_inputs():
    """Scores that grow along the keys (every block raises the running max, so every
    block rescales the sums before it), and q / out / k / v as strided views."""
    query_len, seq_len, num_heads, num_kv_heads, head_size = 50, 300, 4, 2, 64
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(query_len, num_heads, 2 * head_size, generator=gen).bfloat16()[..., :head_size]
    direction = torch.randn(head_size, generator=gen)
    ramp = torch.linspace(0, 6, seq_len)[None, :, None]
    k = (torch.randn(num_kv_heads, seq_len, head_size, generator=gen) * 0.1
         + ramp * direction).bfloat16()
    q = (q.float() * 0.1 + direction).bfloat16()
    v_wide = torch.randn(seq_len, num_kv_heads, head_size, generator=gen).bfloat16()
    v = v_wide.transpose(0, 1)  # [Hkv, S, D] with token stride Hkv * D
    out_wide = torch.zeros(query_len, num_heads, 2 * head_size, dtype=torch.bfloat16)
    out = out_wide[..., head_size:]
    prefill_attention_kernel()(out, q, k, v, head_size ** -0.5)
    want = causal_reference(q, k, v, head_size ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    assert (out_wide[..., :head_size] == 0).all()  # nothing written outside the view


def test_bad_inputs_raise_before_any_work():
    kernel = prefill_attention_kernel()
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(q.float(), q.float(), kv.float(), kv.float(), 0.125)
    with pytest.raises(RuntimeError, match="head size"):
        kernel(q[..., :32], q[..., :32], kv[..., :32], kv[..., :32], 0.125)
    with pytest.raises(RuntimeError, match="S >= L"):
        kernel(q, q, kv[:, :2], kv[:, :2], 0.125)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[torch.Size]:
    """The query shape of each call the backend makes to the kernel from now on."""
    calls = []
    kernel = prefill_attention_kernel()

    def counting(*args):
        calls.append(args[1].shape)
        kernel(*args)

    monkeypatch.setattr(torch_backend, "prefill_attention_kernel", lambda: counting)
    return calls


def test_backend_takes_the_kernel_for_bfloat16_chunks(kernel_calls):
    """_causal_attention (the SDPA prefill path) calls the kernel for a bfloat16 chunk after
    cached context and for a fresh prompt, and keeps torch's kernel for float32."""
    gen = torch.Generator().manual_seed(3)
    scores = torch_backend.Scores(0.125)
    for query_len, seq_len in [(200, 200), (90, 333)]:
        q = torch.randn(query_len, 8, 64, generator=gen).bfloat16()
        k = torch.randn(2, seq_len, 64, generator=gen).bfloat16()
        v = torch.randn(2, seq_len, 64, generator=gen).bfloat16()
        out = torch_backend._causal_attention(q, k, v, scores)
        torch.testing.assert_close(out.double(), causal_reference(q, k, v, 0.125),
                                   atol=2e-2, rtol=2e-2)
        torch_backend._causal_attention(q.float(), k.float(), v.float(), scores)
    assert kernel_calls == [(200, 8, 64), (90, 8, 64)]


def test_bfloat16_model_long_chunked_prompts_match_transformers(tmp_path, kernel_calls):
    """A bfloat16 Llama (head size 64) on prompts of up to 300 tokens in chunks of up to 128
    (so after the first chunk each attends over cached context): the kernel runs and the
    greedy tokens match transformers' float32 ones under the near-tie rule."""
    from engine import LLM
    from tests.support.correctness import GREEDY, generate_ids, hf_reference, make_prompts
    from tests.support.hf_reference import assert_greedy_matches
    from tests.support.model_fixtures import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path, "llama", head_dim=64, max_position_embeddings=512)
    prompts = make_prompts(seed=11)
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=512, max_num_batched_tokens=128)
    ours = generate_ids(llm, prompts, GREEDY)
    assert kernel_calls and max(shape[0] for shape in kernel_calls) > 64
    assert_greedy_matches(ours, hf_reference(model_dir, prompts))
