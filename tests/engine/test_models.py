"""Our model implementations against HF transformers on the same tiny random weights."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.attention import Attention, AttentionMetadata, set_forward_context
from engine.attention.backends.torch_backend import TorchAttentionBackend
from engine.model_loader import iter_safetensors, load_model, resolve_dtype
from engine.models import get_model_class, supported_architectures
from engine.models.moe import SparseMoeBlock
from engine.models.rotary import compute_inv_freq, rope_parameters
from tests.support.hf_reference import load_hf_model
from tests.support.model_fixtures import (
    ARCHITECTURES,
    build_hf_model,
    build_tiny_checkpoint,
    build_tiny_tokenizer,
    hf_logits,
    prefill_logits,
    prompts_for,
    tiny_config,
)

TEXTS = [
    "Hello, world! How are you today?",
    "The quick brown fox",
    "A paged KV cache stores keys and values in fixed-size blocks; continuous batching "
    "schedules new requests at every step.",
]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return prompts_for(build_tiny_tokenizer(), TEXTS)


def load_hf(model_dir):
    return load_hf_model(model_dir)


def assert_logits_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Within 1e-4 of the logit scale, and the same greedy token everywhere."""
    scale = max(1.0, reference.abs().max().item())
    assert ours.shape == reference.shape
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference, atol=1e-4 * scale, rtol=0)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_prefill_matches_hf(arch, tmp_path, prompts):
    model_dir = build_tiny_checkpoint(tmp_path, arch)
    ours = load_model(model_dir, torch.float32, "cpu")
    assert type(ours).__name__ == json.loads((model_dir / "config.json").read_text())[
        "architectures"][0]
    assert_logits_close(prefill_logits(ours, prompts), hf_logits(load_hf(model_dir), prompts))


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16.0},
}


@pytest.mark.parametrize("name", ROPE_SCALINGS)
def test_rope_scaling_matches_hf(name, tmp_path, prompts):
    scaling = dict(ROPE_SCALINGS[name], rope_theta=10000.0)
    model_dir = build_tiny_checkpoint(tmp_path, "llama", rope_parameters=scaling)
    ours = load_model(model_dir, torch.float32, "cpu")
    default_inv_freq, _ = compute_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, 16, 256)
    scaled = not torch.equal(ours.model.rotary_emb.inv_freq, default_inv_freq)
    assert scaled == (name != "dynamic")  # dynamic only departs beyond max_position_embeddings
    assert_logits_close(prefill_logits(ours, prompts), hf_logits(load_hf(model_dir), prompts))


def test_rope_parameters_from_old_style_config():
    old = SimpleNamespace(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"type": "linear", "factor": 2.0, "rope_type": "linear",
                                    "rope_theta": 500000.0, "partial_rotary_factor": 1.0}
    assert rope_parameters(SimpleNamespace())["rope_type"] == "default"
    with pytest.raises(ValueError, match="longrope"):  # the error names the supported ones
        compute_inv_freq({"rope_type": "ntk-by-parts", "rope_theta": 1e4}, 16, 256)


@pytest.mark.parametrize("max_position_embeddings", [128, 512], ids=["short", "long"])
def test_longrope_matches_hf(max_position_embeddings):
    """Phi-3's LongRoPE: the short factors while the model's context is its original one,
    the long factors (transformers' choice past the original length) once it is longer;
    the attention factor from max_position_embeddings / original as in transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config("phi3", max_position_embeddings=max_position_embeddings,
                         original_max_position_embeddings=128, rope_scaling={
                             "rope_type": "longrope", "short_factor": [1.0 + i for i in range(8)],
                             "long_factor": [2.0 + 3 * i for i in range(8)]})
    ours = load_model_class_rotary(config)
    seq_len = 129 if max_position_embeddings > 128 else 16
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=seq_len)
    torch.testing.assert_close(ours.inv_freq, hf_inv_freq)
    assert ours.attention_factor == pytest.approx(hf_factor)
    assert (hf_factor > 1.0) == (max_position_embeddings > 128)


def test_rotary_tables_give_the_computed_values_to_the_bit():
    """On the CPU cos/sin come from tables of positions 0..n-1 that grow by powers of
    two; positions past TABLE_ROWS_MAX are computed. Every answer equals the direct
    computation bit for bit (YaRN's attention factor included)."""
    from engine.models import rotary

    config = tiny_config("llama", max_position_embeddings=4096, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    rope = load_model_class_rotary(config)
    assert rope.attention_factor != 1.0
    # One position (a decode) is a view of its row; the rest gathers rows.
    asked = [torch.arange(150), torch.tensor([300]), torch.tensor([7, 2000, 3]),
             torch.tensor([5]), torch.tensor([], dtype=torch.long),
             torch.tensor([rotary.TABLE_ROWS_MAX + 5])]
    rows_after = [256, 512, 2048, 2048, 2048, 2048]
    for positions, rows in zip(asked, rows_after, strict=True):
        cos, sin = rope(positions)
        want_cos, want_sin = rope._compute(positions)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert cos.is_contiguous() and rope._table_rows == rows


def load_model_class_rotary(config):
    from engine.models.rotary import RotaryEmbedding

    return RotaryEmbedding.from_config(config, 16)


def test_tied_embeddings(tmp_path, prompts):
    model_dir = build_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in dict(iter_safetensors(model_dir))
    ours = load_model(model_dir, torch.float32, "cpu")
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    assert_logits_close(prefill_logits(ours, prompts), hf_logits(load_hf(model_dir), prompts))


def test_sharded_checkpoint(tmp_path, prompts):
    model_dir = build_tiny_checkpoint(tmp_path, "qwen2", max_shard_size="60KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours = load_model(model_dir, torch.float32, "cpu")
    assert_logits_close(prefill_logits(ours, prompts), hf_logits(load_hf(model_dir), prompts))


def test_moe_respects_dense_layers(tmp_path, prompts):
    # layer 0 is listed dense; with decoder_sparse_step=1 layer 1 is sparse
    model_dir = build_tiny_checkpoint(tmp_path, "qwen3_moe", num_hidden_layers=3,
                                      mlp_only_layers=[0], norm_topk_prob=False)
    ours = load_model(model_dir, torch.float32, "cpu")
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert kinds == [False, True, True]
    assert_logits_close(prefill_logits(ours, prompts), hf_logits(load_hf(model_dir), prompts))


def test_moe_loads_stacked_expert_tensors(prompts):
    """transformers v5 keeps experts stacked ([E, 2I, H] gate_up, [E, H, I] down) in memory."""
    config = tiny_config("qwen3_moe")
    hf_model = build_hf_model(config)
    state = hf_model.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    ours = get_model_class(config)(config)
    ours.load_weights(state.items())
    assert_logits_close(prefill_logits(ours, prompts), hf_logits(hf_model, prompts))


def test_unsupported_architecture_names_supported_ones():
    config = tiny_config("llama", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as excinfo:
        get_model_class(config)
    for arch in supported_architectures():
        assert arch in str(excinfo.value)


def test_load_weights_rejects_missing_and_unknown_tensors():
    config = tiny_config("llama")
    state = build_hf_model(config).state_dict()
    model_class = get_model_class(config)
    incomplete = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match="qkv_proj"):
        model_class(config).load_weights(incomplete.items())
    with pytest.raises(ValueError, match="no place"):
        model_class(config).load_weights([*state.items(), ("model.extra.weight", torch.ones(1))])
    wrong_shape = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match="shape"):
        model_class(config).load_weights(wrong_shape.items())


def test_paged_chunked_prefill_and_decode_match_hf(tmp_path, prompts):
    """Through the KV cache: chunked prefill then decodes, requests at different positions."""
    model_dir = build_tiny_checkpoint(tmp_path, "qwen3")
    ours = load_model(model_dir, torch.float32, "cpu")
    block_size, num_blocks = 4, 32
    backend = TorchAttentionBackend()
    for layer in ours.modules():
        if isinstance(layer, Attention):
            layer.kv_cache = torch.zeros(backend.kv_cache_shape(
                num_blocks, block_size, layer.num_kv_heads, layer.head_size))
    requests = prompts[:2]
    block_ids = [[3, 1, 7, 5, 11, 12, 13, 14, 15, 16], [2, 9, 4, 17, 18]]
    # tokens scheduled per request and step: prefill chunks, then single-token decodes
    schedule = [[5, 3], [len(requests[0]) - 5, 1], [0, 1], [0, len(requests[1]) - 5]]
    computed = [0, 0]
    collected: list[list[torch.Tensor]] = [[], []]
    for step in schedule:
        reqs = [r for r in range(2) if step[r] > 0]
        positions = np.concatenate([np.arange(computed[r], computed[r] + step[r]) for r in reqs])
        token_ids = np.concatenate(
            [requests[r][computed[r] : computed[r] + step[r]] for r in reqs])
        req_of_token = np.repeat(np.arange(len(reqs)), [step[r] for r in reqs])
        table = np.array([block_ids[r] + [0] * (10 - len(block_ids[r])) for r in reqs],
                         dtype=np.int32)
        slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
        query_start_loc = np.concatenate([[0], np.cumsum([step[r] for r in reqs])]).astype(
            np.int32)
        seq_lens = np.array([computed[r] + step[r] for r in reqs], dtype=np.int32)
        metadata = AttentionMetadata(
            num_actual_tokens=len(token_ids), max_query_len=max(step),
            max_seq_len=int(seq_lens.max()), query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(seq_lens), block_table=torch.from_numpy(table),
            slot_mapping=torch.from_numpy(slots.astype(np.int64)),
            query_start_loc_np=query_start_loc, seq_lens_np=seq_lens,
        )
        with torch.no_grad(), set_forward_context(metadata, backend):
            hidden = ours(torch.from_numpy(token_ids).long(), torch.from_numpy(positions).long())
        logits = ours.compute_logits(hidden)
        for i, r in enumerate(reqs):
            collected[r].append(logits[query_start_loc[i] : query_start_loc[i + 1]])
            computed[r] += step[r]
    ours_logits = torch.cat([torch.cat(chunks) for chunks in collected])
    assert_logits_close(ours_logits, hf_logits(load_hf(model_dir), requests))


def test_resolve_dtype(monkeypatch):
    from engine import cpu_info

    config = tiny_config("llama")
    config.dtype = torch.float16
    # auto on CPU follows the hardware, whatever the checkpoint says.
    for flags, expected in [({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
                            ({"avx2", "amx_bf16"}, torch.bfloat16),
                            ({"avx2", "fma"}, torch.float32), (set(), torch.float32)]:
        monkeypatch.setattr(cpu_info, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert resolve_dtype(config, "auto", "cpu") == expected, flags
    assert resolve_dtype(config, "auto", "cuda") == torch.float16
    assert resolve_dtype(config, "float16", "cpu") == torch.float16
    assert resolve_dtype(config, "float32", "cpu") == torch.float32
    config.dtype = None
    assert resolve_dtype(config, "auto", "cuda") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype(config, "int8", "cpu")


def test_load_model_in_bfloat16_is_eval_without_grad(tmp_path, prompts):
    ours = load_model(build_tiny_checkpoint(tmp_path, "qwen2"), torch.bfloat16, "cpu")
    assert not ours.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ours.parameters())
    logits = prefill_logits(ours, prompts)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert torch.get_default_dtype() == torch.float32  # restored after loading
