"""Greedy reference outputs from Hugging Face transformers, and the near-tie comparison."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K_FOR_TIES = 5


@dataclass
class Reference:
    token_ids: list[list[int]]
    top5: list[list[list[int]]]  # per prompt, per step: transformers' top-5 token ids
    logprobs: list[torch.Tensor]  # per prompt: [steps, vocab] log-softmax of raw logits


def load_hf_model(model_dir):
    """transformers' model of `model_dir` in float32: a checkpoint directory, or one of our
    GGUF cache directories, whose GGUF file transformers then loads (dequantized) itself."""
    from transformers import AutoModelForCausalLM

    from engine.model_loader.gguf import gguf_source

    gguf_file = gguf_source(model_dir)
    if gguf_file is not None:
        return AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy_reference(
    model_dir, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool
) -> Reference:
    """transformers `generate` (greedy, fp32) for each prompt on its own."""
    model = load_hf_model(model_dir)
    extra = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    ref = Reference([], [], [])
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0, **extra,
            )
            logits = torch.cat(out.logits).float()  # [steps, vocab], before any processor
            ref.token_ids.append(out.sequences[0, len(prompt):].tolist())
            ref.top5.append(logits.topk(TOP_K_FOR_TIES, dim=-1).indices.tolist())
            ref.logprobs.append(torch.log_softmax(logits, dim=-1))
    return ref


def assert_greedy_matches(ours: list[list[int]], ref: Reference,
                          max_gap: float | None = None) -> int:
    """Token-exact, except that a near-tie may flip a token: then our token must be in
    transformers' top-5 at that step and the comparison of that sequence stops there.
    With `max_gap`, a flip must also be a tie in numbers: transformers' logprob of its
    token exceeds its logprob of ours by at most `max_gap`.

    Returns the number of sequences that ended in such a flip.
    """
    num_flips = 0
    for i, (got, want) in enumerate(zip(ours, ref.token_ids, strict=True)):
        for step, (a, b) in enumerate(zip(got, want, strict=False)):
            if a != b:
                assert a in ref.top5[i][step], (
                    f"prompt {i} step {step}: ours {a}, transformers {b}, "
                    f"top-5 {ref.top5[i][step]}"
                )
                gap = float(ref.logprobs[i][step][b] - ref.logprobs[i][step][a])
                assert max_gap is None or gap <= max_gap, (
                    f"prompt {i} step {step}: ours {a}, transformers {b}: not a near-tie, "
                    f"logprob gap {gap:.3f} > {max_gap}"
                )
                num_flips += 1
                break
        else:
            assert len(got) == len(want), f"prompt {i}: {len(got)} tokens vs {len(want)}"
    return num_flips
