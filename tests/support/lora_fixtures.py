"""Random PEFT LoRA adapters on a tiny base, and transformers + peft references."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.hf_reference import Reference, load_hf_model

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, targets, rsLoRA): different ranks, different modules.
ADAPTER_SPECS = {
    "a4": (4, 8, ["q_proj", "v_proj"], False),
    "b8": (8, 16, ALL_LINEARS, False),
    "c16": (16, 8, ["o_proj", "gate_proj", "down_proj"], True),
    "d2": (2, 4, ["k_proj", "up_proj"], False),
}


def build_adapter(base_dir: Path, out_dir: Path, name: str, seed: int) -> Path:
    """Save adapter `name` of ADAPTER_SPECS with random A and B (not PEFT's zero B)."""
    from peft import LoraConfig, get_peft_model

    rank, alpha, targets, rslora = ADAPTER_SPECS[name]
    torch.manual_seed(seed)
    model = load_hf_model(base_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # large enough to change the greedy tokens of a random base
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.normal_(0.0, 0.3)
    path = out_dir / name
    peft_model.save_pretrained(path)
    return path


def peft_greedy_reference(base_dir: Path, adapter: Path | None, prompts: list[list[int]],
                          max_new_tokens: int) -> Reference:
    """transformers `generate` with peft applying `adapter` (not merged), greedy, fp32."""
    from peft import PeftModel

    model = load_hf_model(base_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ref = Reference([], [], [])
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]), do_sample=False,
                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            logits = torch.cat(out.logits).float()
            ref.token_ids.append(out.sequences[0, len(prompt):].tolist())
            ref.top5.append(logits.topk(5, dim=-1).indices.tolist())
            ref.logprobs.append(torch.log_softmax(logits, dim=-1))
    return ref
