"""Tiny random checkpoints built offline, plus helpers to run our models without a runner.

    build_tiny_checkpoint(dir, "qwen3")      -> dir with config.json, model.safetensors,
                                                tokenizer files (with a chat template)
    prefill_logits(model, [[1, 2], [3]])     -> logits [3, vocab] for fresh prompts
    greedy_generate(model, [1, 2, 3], 5)     -> 5 greedy token ids (no KV cache)

Weights are seeded and drawn with std `initializer_range` = 0.2 (HF's 0.02
gives near-uniform logits and argmax ties); norm weights and biases are
perturbed away from HF's 1/0 init so that loading them wrongly shows.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "phi3", "gemma3",
                 "gemma2")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching schedules new requests at every step.",
    "Hello, world! How are you today? I am fine, thank you.",
    "def forward(self, input_ids, positions): return self.model(input_ids, positions)",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159",
] * 4

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                   "qwen3_moe": "Qwen3MoeConfig", "mistral": "MistralConfig",
                   "phi3": "Phi3Config", "gemma3": "Gemma3TextConfig",
                   "gemma2": "Gemma2Config"}
_ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    return tokenizer.to_str()


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer (~400 tokens) with a ChatML template; built offline."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(arch: str = "llama", **overrides: Any):
    """A 2-layer, hidden-64, 4-query/2-KV-head config of `arch` (one of ARCHITECTURES)."""
    import transformers

    tokenizer = build_tiny_tokenizer()
    kwargs: dict[str, Any] = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
        rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, architectures=[_ARCH_CLASSES[arch]],
    )
    if arch == "mistral":
        kwargs.update(sliding_window=None)  # the default, 4096, is past every tiny context
    if arch == "gemma3":
        # 6 layers, 5 local : 1 global (layer 5), a 20-token window, both RoPE bases.
        del kwargs["rope_theta"]
        kwargs.update(num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=20,
                      final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                      rope_parameters={
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                          "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    if arch == "gemma2":
        # 2 layers, local (window 20) then global, one RoPE base; attention scores
        # soft-capped at 5 (Gemma 2's 50 would barely bend a tiny model's scores).
        kwargs.update(num_hidden_layers=2, query_pre_attn_scalar=16, sliding_window=20,
                      attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                      hidden_activation="gelu_pytorch_tanh")
    if arch == "qwen3_moe":
        kwargs.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    kwargs.update(overrides)
    return getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs)


# A Phi-4-mini-shaped tiny Phi-3 (tests/data/gguf/tiny-phi4-longrope-F32.gguf, and the
# checkpoint its test rebuilds): LongRoPE past a 16-token original context (so every prompt
# of 17+ tokens takes the long factors, in transformers as here), rotary on 0.75 of each
# head (Phi-4-mini's), tied embeddings, and a 24-token window on every layer (Phi-3-mini-4k).
TINY_PHI4_LONGROPE = dict(
    hidden_size=128, intermediate_size=256, head_dim=32, tie_word_embeddings=True,
    partial_rotary_factor=0.75, max_position_embeddings=512,
    original_max_position_embeddings=16, sliding_window=24,
    rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(12)],
                  "long_factor": [2.0 + 0.5 * i for i in range(12)]})


def build_hf_model(config, seed: int = 0):
    """The HF reference model for `config`, seeded random weights (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_constant_weights(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def randomize_constant_weights(model, generator: torch.Generator) -> None:
    """Give random values to what HF initializes to constants (norms around 1, biases, an
    MoE router's zeros), so that a test sees a wrong use of any of them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            elif name.endswith("mlp.gate.weight"):  # MoE router: HF inits it to zeros
                param.copy_(model.config.initializer_range * noise)


def build_tiny_checkpoint(
    out_dir: str | Path, arch: str = "llama", *, seed: int = 0,
    max_shard_size: str | None = None, **config_overrides: Any,
) -> Path:
    """Save a tiny random `arch` checkpoint (safetensors) and tokenizer into `out_dir`.

    `max_shard_size` (e.g. "40KB") makes it sharded with an index; config
    overrides are passed to the config class (e.g. tie_word_embeddings=True,
    rope_scaling={...}).
    """
    out_dir = Path(out_dir)
    model = build_hf_model(tiny_config(arch, **config_overrides), seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


def prompts_for(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in texts]


def prefill_metadata(lengths: list[int]):
    """AttentionMetadata for fresh prefills of `lengths` tokens each, no KV cache."""
    from engine.attention import AttentionMetadata

    query_start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    seq_lens = np.asarray(lengths, dtype=np.int32)
    num_tokens = int(query_start_loc[-1])
    return AttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(lengths), max_seq_len=max(lengths),
        query_start_loc=torch.from_numpy(query_start_loc), seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.zeros((len(lengths), 1), dtype=torch.int32),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        query_start_loc_np=query_start_loc, seq_lens_np=seq_lens,
    )


@torch.no_grad()
def prefill_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Logits [sum(len), vocab] of our `model` over the prompts batched in one forward.

    Positions restart at 0 for each prompt, as for fresh requests.
    """
    from engine.attention import set_forward_context
    from engine.attention.backends.torch_backend import TorchAttentionBackend

    input_ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with set_forward_context(prefill_metadata([len(p) for p in prompts]), TorchAttentionBackend()):
        hidden_states = model(input_ids, positions)
    return model.compute_logits(hidden_states)


@torch.no_grad()
def hf_logits(hf_model, prompts: list[list[int]]) -> torch.Tensor:
    """The HF model's logits for each prompt run alone, concatenated like `prefill_logits`."""
    return torch.cat([hf_model(torch.tensor([p])).logits[0].float() for p in prompts])


def greedy_generate(model, prompt: list[int], max_new_tokens: int,
                    stop_token_id: int | None = None) -> list[int]:
    """Greedy decoding by re-running the whole sequence each step (slow; tests only)."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        next_id = int(prefill_logits(model, [tokens])[-1].argmax())
        tokens.append(next_id)
        if next_id == stop_token_id:
            break
    return tokens[len(prompt):]


# -- tiny GGUF files ------------------------------------------------------------------------
# Written here independently of engine.model_loader.gguf (llama.cpp's naming and
# its Llama q/k row permutation), so the converter is checked against the
# original HF weights rather than against itself.

# Mistral is written as llama (as llama.cpp does), with `llama.attention.sliding_window`
# when the checkpoint has a window (which llama.cpp's converter leaves out).
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
              "gemma3": "gemma3", "mistral": "llama", "gemma2": "gemma2"}
GGUF_ARCHITECTURES = tuple(_GGUF_ARCH)  # those build_tiny_gguf writes
_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
}


# llama.cpp's Gemma 3 names for its extra norms (and its pre-feedforward one).
_GEMMA3_TO_GGUF = {**_TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                   "pre_feedforward_layernorm": "ffn_norm",
                   "post_feedforward_layernorm": "post_ffw_norm"}


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k rows, restated."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def build_tiny_gguf(hf_dir: str | Path, gguf_path: str | Path, arch: str,
                    matrix_type=None) -> Path:
    """Write the tiny HF checkpoint in `hf_dir` as a GGUF file like llama.cpp would.

    float32, or with every 2-D weight (linears, embedding) quantized to `matrix_type`
    (a gguf.GGMLQuantizationType such as Q4_1) by gguf's own quantizer.
    """
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf_dir, gguf_path = Path(hf_dir), Path(gguf_path)
    config = AutoConfig.from_pretrained(hf_dir)
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update({k: v.float().numpy() for k, v in load_file(file).items()})

    writer = gguf.GGUFWriter(str(gguf_path), _GGUF_ARCH[arch])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if arch == "gemma3"
                              else rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "mistral" and config.sliding_window:
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":  # llama.cpp: window, both soft-caps; every other layer global
        writer.add_sliding_window(config.sliding_window)
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma3":  # llama.cpp: window, soft-cap; every 6th layer global, local base 10k
        writer.add_sliding_window(config.sliding_window)
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "qwen3_moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)

    tokenizer = build_tiny_tokenizer()
    tokenizer_json = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer_json["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add_tensor(gguf_name: str, weight: np.ndarray) -> None:
        if matrix_type is not None and weight.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(weight, matrix_type),
                              raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name, weight)

    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    to_gguf = _GEMMA3_TO_GGUF if arch in ("gemma2", "gemma3") else _TO_GGUF
    for name, weight in state.items():
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            weight = weight + 1.0  # llama.cpp stores Gemma's (1 + w)
        if name == "model.embed_tokens.weight":
            add_tensor("token_embd.weight", weight)
        elif name == "model.norm.weight":
            add_tensor("output_norm.weight", weight)
        elif name == "lm_head.weight":
            add_tensor("output.weight", weight)
        else:
            _, _, layer, rest = name.split(".", 3)
            module, leaf = rest.rsplit(".", 1)
            if ".experts." in module:  # mlp.experts.{e}.{proj}
                _, _, expert, proj = module.split(".")
                experts.setdefault((layer, proj), {})[int(expert)] = weight
                continue
            if _GGUF_ARCH[arch] == "llama" and module == "self_attn.q_proj":
                weight = _llama_cpp_permute(weight, config.num_attention_heads)
            if _GGUF_ARCH[arch] == "llama" and module == "self_attn.k_proj":
                weight = _llama_cpp_permute(weight, config.num_key_value_heads)
            add_tensor(f"blk.{layer}.{to_gguf[module]}.{leaf}", weight)
    for (layer, proj), by_expert in experts.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        kind = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps",
                "down_proj": "ffn_down_exps"}[proj]
        writer.add_tensor(f"blk.{layer}.{kind}.weight", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path
