"""GGUF files as users get them (llama.cpp's converter + llama-quantize: tests/data/gguf),
served in place: greedy parity with transformers (which loads and dequantizes the same
file) under the near-tie rule, with prefix hits, chunked prefill and preemption at once;
the weights kept packed in their own formats (no dense copy); batch invariance; and the
one-line start-up errors for files we cannot serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pagedserve_kernels.cpu_kernels
from engine import LLM, SamplingParams, cpu_info
from engine.model_loader import ModelSourceError, load_model, resolve_model
from engine.models.gguf_weight import GGUFWeight, StackedWeight
from engine.models.quant import KERNEL_CALLS, QuantizedWeight
from engine.models.weight_arena import model_tensors
from tests.support.hf_reference import assert_greedy_matches, hf_greedy_reference
from tests.support.model_fixtures import (
    TINY_PHI4_LONGROPE,
    build_tiny_checkpoint,
    prefill_logits,
)

FIXTURES = Path(__file__).parents[1] / "data" / "gguf"
needs_kernels = pytest.mark.skipif(not pagedserve_kernels.cpu_kernels.toolchain_available(),
                                   reason="no C++ compiler/ninja to build the CPU kernels")
ALL_FILES = sorted(p.name for p in FIXTURES.glob("*.gguf") if "-lora-" not in p.name)  # models
# transformers reads a phi3 GGUF without its LongRoPE factors and window: this file is
# compared with the checkpoint it was converted from instead.
PHI4_LONGROPE = "tiny-phi4-longrope-F32.gguf"
# A shared 40-token prefix (prefix-cache hits across requests), prompts longer than the
# 16-token chunks the engine is given, and a short one.
PREFIX = [(7 * i + 3) % 380 + 10 for i in range(40)]
PROMPTS = [PREFIX + [11, 12, 13], PREFIX + [200, 201], PREFIX[:20] + [99] * 15, [5, 6, 7],
           [(11 * i) % 370 + 20 for i in range(33)]]
MAX_TOKENS = 10
NEAR_TIE_LOGPROB_GAP = 0.2


def stressed_llm(path: Path, **kwargs) -> LLM:
    """Chunks of 16 tokens, room for only ~2 requests' blocks (preemption), prefix caching."""
    return LLM(str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=16,
               block_size=16, num_gpu_blocks_override=9, enable_prefix_caching=True, **kwargs)


def greedy(llm: LLM, prompts, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=logprobs)
    return llm.generate(prompts, params, use_tqdm=False)


@needs_kernels
@pytest.mark.parametrize("name", [n for n in ALL_FILES if n != PHI4_LONGROPE])
def test_gguf_file_matches_transformers_under_prefix_hits_chunks_and_preemption(name):
    llm = stressed_llm(FIXTURES / name)
    got = [o.outputs[0].token_ids for o in greedy(llm, PROMPTS)]
    reference = hf_greedy_reference(llm.model_dir, PROMPTS, MAX_TOKENS, ignore_eos=True)
    assert assert_greedy_matches(got, reference, max_gap=NEAR_TIE_LOGPROB_GAP) <= 1


@needs_kernels
def test_q4_k_m_tensors_stay_packed_and_k_quants_repack_exactly(tmp_path):
    cache = tmp_path / "cache"
    resolved = resolve_model(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), cache_dir=cache)
    model = load_model(resolved.path, torch.float32, "cpu", "auto")
    report = model.gguf_report
    assert not report.packed_types  # nothing left as the file's bytes: every type repacks
    assert dict(report.repacked_types) == {"Q4_K": 13, "Q6_K": 3}
    layer = model.model.layers[0]
    # Q4_K_M keeps attn_v and ffn_down of some layers in Q6_K: a stacked qkv then.
    packed = [layer.self_attn.qkv_proj.quantized, layer.self_attn.o_proj.quantized,
              layer.mlp.gate_up_proj.quantized, layer.mlp.down_proj.quantized,
              model.lm_head.quantized, model.model.embed_tokens.packed]
    assert all(isinstance(p, (GGUFWeight, StackedWeight, QuantizedWeight)) for p in packed)
    assert isinstance(layer.mlp.gate_up_proj.quantized, QuantizedWeight)
    assert layer.mlp.gate_up_proj.quantized.scale_form == "super-blocks-160"
    dense = load_model(resolved.path, torch.float32, "cpu", "none")
    torch.testing.assert_close(layer.mlp.gate_up_proj.quantized.dequantized(),
                               dense.model.layers[0].mlp.gate_up_proj.weight, atol=0, rtol=0)
    # the tied embedding (Q6_K, six bits as in the file) looked up row by row, exactly
    ids = torch.tensor([0, 7, 511, 7])
    torch.testing.assert_close(model.model.embed_tokens.packed.dequantize_rows(ids),
                               dense.model.embed_tokens.weight[ids], atol=0, rtol=0)
    # no dense weight anywhere but the norms: parameters hold a few KB
    dense_elements = sum(p.numel() for p in model.parameters())
    assert dense_elements == 2 * 2 * 256 + 256  # two norms per layer, the final norm
    # every tensor of the file is accounted for, bytes for bytes
    file_bytes = (FIXTURES / "tiny-llama-Q4_K_M.gguf").stat().st_size
    # (a repacked Q4_K block holds 148 bytes per 256 weights against the file's 144)
    assert 0.9 * file_bytes < report.packed_bytes <= 1.03 * file_bytes
    # the cache holds no weights
    assert sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) < 0.1 * file_bytes


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (Linux)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    return []


def test_weights_move_into_one_huge_page_arena_in_module_order(tmp_path, monkeypatch):
    """After loading, every weight tensor (packed blocks, scales, norms) lives in one
    allocation, in the order the forward reads them, advised for 2 MiB pages; the
    logits are the same to the bit as with the weights left where loading put them."""
    resolved = resolve_model(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), cache_dir=tmp_path)
    model = load_model(resolved.path, torch.float32, "cpu", "auto")
    tensors = [t for t in model_tensors(model) if t.numel()]
    arena = tensors[0].untyped_storage()
    assert all(t.untyped_storage().data_ptr() == arena.data_ptr() for t in tensors)
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert starts[0] % (2 << 20) == 0  # the arena starts on a huge page
    assert "hg" in vm_flags(starts[0])  # madvise(MADV_HUGEPAGE)
    layer = model.model.layers[1]
    assert layer.mlp.down_proj.quantized.tensors()[0].data_ptr() in starts  # a packed weight
    monkeypatch.setenv("PAGEDSERVE_WEIGHT_ARENA", "0")
    scattered = load_model(resolved.path, torch.float32, "cpu", "auto")
    assert len({t.untyped_storage().data_ptr() for t in model_tensors(scattered)}) > 1
    prompts = [[1, 5, 9, 13], [2, 4, 6, 8, 10, 12]]
    assert torch.equal(prefill_logits(model, prompts), prefill_logits(scattered, prompts))
    # Without room for a second copy of the weights they stay where loading put them.
    monkeypatch.delenv("PAGEDSERVE_WEIGHT_ARENA")
    monkeypatch.setattr(cpu_info, "available_memory_bytes", lambda: 1 << 20)
    kept = load_model(resolved.path, torch.float32, "cpu", "auto")
    assert len({t.untyped_storage().data_ptr() for t in model_tensors(kept)}) > 1


@needs_kernels
@pytest.mark.parametrize("name,ggml_type,form", [
    ("tiny-llama-Q5_K_M.gguf", "Q5_K", "super-blocks-160+mins"),
    ("tiny-llama-Q3_K_M.gguf", "Q3_K", "super-blocks-288")])
def test_q5_k_and_q3_k_repack_exactly_into_blocked_int8(name, ggml_type, form):
    """Q5_K (five-bit values, Q4_K's six-bit scales and mins) becomes blocked int8 q with
    super-block scale and min lanes; Q3_K takes Q6_K's six-bit form and 16-column scales:
    the dequantized weights are the file's, exactly, and nothing stays in its blocks."""
    resolved = resolve_model(str(FIXTURES / name))
    model = load_model(resolved.path, torch.float32, "cpu", "auto")
    report = model.gguf_report
    assert not report.packed_types and report.repacked_types[ggml_type] > 0
    dense = load_model(resolved.path, torch.float32, "cpu", "none")
    repacked = [(name, module.quantized) for name, module in model.named_modules()
                if isinstance(getattr(module, "quantized", None), QuantizedWeight)
                and module.quantized.scale_form == form]
    assert repacked
    for name, weight in repacked:
        assert weight.spec.method == "int8" and (weight.mins is not None) == form.endswith("mins")
        torch.testing.assert_close(weight.dequantized(), dense.get_submodule(name).weight,
                                   atol=0, rtol=0)


@needs_kernels
def test_fallback_types_of_a_q4_k_m_file_are_repacked_exactly():
    """Rows of 320 are no K-quant: llama-quantize wrote ffn_down as Q5_0/Q8_0 there."""
    resolved = resolve_model(str(FIXTURES / "tiny-llama-i320-Q4_K_M.gguf"))
    model = load_model(resolved.path, torch.float32, "cpu", "auto")
    assert dict(model.gguf_report.repacked_types) == {"Q4_K": 12, "Q5_0": 1, "Q6_K": 2,
                                                      "Q8_0": 1}
    downs = [layer.mlp.down_proj.quantized for layer in model.model.layers]
    assert all(isinstance(d, QuantizedWeight) and d.spec.method == "int8" for d in downs)
    dense = load_model(resolved.path, torch.float32, "cpu", "none")
    for ours, reference in zip(downs, dense.model.layers, strict=True):
        torch.testing.assert_close(ours.dequantized(), reference.mlp.down_proj.weight,
                                   atol=0, rtol=0)


@needs_kernels
def test_phi3_longrope_file_matches_its_source_checkpoint(tmp_path):
    """Phi-4-mini's shape as llama.cpp writes it: LongRoPE factors as tensors, rotary on
    24 of 32 dims, tied embeddings, a 24-token window; prompts of 17+ tokens outgrow the
    16-token original context (long factors) and the window."""
    source = build_tiny_checkpoint(tmp_path / "hf", "phi3", seed=0, **TINY_PHI4_LONGROPE)
    llm = stressed_llm(FIXTURES / PHI4_LONGROPE)
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from engine.model_loader.gguf_file import GGUFFile

    embed = load_file(source / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(torch.from_numpy(GGUFFile(FIXTURES / PHI4_LONGROPE)
                                        .load("token_embd.weight")), embed), \
        "the fixture is not this checkpoint's: rerun tests/data/gguf/make_fixtures.py"
    ours, theirs = (AutoConfig.from_pretrained(d) for d in (llm.model_dir, source))
    assert ours.architectures == ["Phi3ForCausalLM"] and ours.sliding_window == 24
    assert ours.partial_rotary_factor == 0.75 and ours.tie_word_embeddings
    for key in ("rope_type", "long_factor", "short_factor", "original_max_position_embeddings"):
        assert ours.rope_parameters[key] == pytest.approx(theirs.rope_parameters[key]), key
    prompts = [p for p in PROMPTS if len(p) > 16]
    got = [o.outputs[0].token_ids for o in greedy(llm, prompts)]
    reference = hf_greedy_reference(source, prompts, MAX_TOKENS, ignore_eos=True)
    assert assert_greedy_matches(got, reference, max_gap=NEAR_TIE_LOGPROB_GAP) == 0


@needs_kernels
def test_phi3_fused_tensors_are_served_whole_and_split_when_dense():
    """attn_qkv / ffn_up (gate and up) stay one packed weight each (a Q4_K_M mix: Q4_K in
    layer 0, repacked, Q6_K in layer 1; Q4_0 repacked); unpacked, they load as their q/k/v
    and gate/up pieces (the tensor-parallel path), to the same values."""
    k_quant = load_model(resolve_model(str(FIXTURES / "tiny-phi3-Q4_K_M.gguf")).path,
                         torch.float32, "cpu", "auto")
    assert not k_quant.gguf_report.packed_types
    assert dict(k_quant.gguf_report.repacked_types) == {"Q4_K": 7, "Q6_K": 3}
    for layer in k_quant.model.layers:
        for linear in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            assert isinstance(linear.quantized, QuantizedWeight)
    resolved = resolve_model(str(FIXTURES / "tiny-phi3-Q4_0.gguf"))
    packed = load_model(resolved.path, torch.float32, "cpu", "auto")
    assert dict(packed.gguf_report.repacked_types) == {"Q4_0": 9, "Q6_K": 1}
    dense = load_model(resolved.path, torch.float32, "cpu", "none")
    for ours, reference in zip(packed.model.layers, dense.model.layers, strict=True):
        for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
            weight = ours.get_submodule(name).quantized
            assert isinstance(weight, QuantizedWeight)
            torch.testing.assert_close(weight.dequantized(),
                                       reference.get_submodule(name).weight, atol=0, rtol=0)


@pytest.fixture
def restore_batch_invariance():
    """The engine sets the process-wide switch; later tests in this process expect it off."""
    from engine import batch_invariant

    yield
    batch_invariant.set_enabled(False)


@needs_kernels
def test_batch_invariance_same_tokens_and_logprobs_alone_or_beside_31_others(
        restore_batch_invariance):
    llm = LLM(str(FIXTURES / "tiny-llama-Q4_K_M.gguf"), dtype="float32", max_model_len=128,
              max_num_batched_tokens=64, batch_invariant=True)
    others = [[(13 * i + j) % 390 + 5 for j in range(5 + i % 40)] for i in range(31)]
    alone = [greedy(llm, [p], logprobs=2)[0].outputs[0] for p in PROMPTS[:2]]
    before = KERNEL_CALLS["tiled"]
    together = greedy(llm, PROMPTS[:1] + others + PROMPTS[1:2], logprobs=2)
    assert KERNEL_CALLS["tiled"] == before  # every batch on the per-row kernels
    for single, batched in zip(alone, [together[0].outputs[0], together[-1].outputs[0]],
                               strict=True):
        assert single.token_ids == batched.token_ids
        assert single.logprobs.token_ids == batched.logprobs.token_ids
        assert single.logprobs.logprobs == batched.logprobs.logprobs  # bitwise: == on floats


def test_unservable_files_are_one_line_errors(tmp_path):
    source = FIXTURES / "tiny-llama-Q4_K_M.gguf"
    data = source.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:100])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf at all" * 10)
    for path, words in ((truncated, "truncated"), (header_only, "truncated or corrupt"),
                        (garbage, "not a GGUF file")):
        with pytest.raises(ModelSourceError) as excinfo:
            resolve_model(str(path), cache_dir=tmp_path / "cache")
        message = str(excinfo.value)
        assert words in message and "\n" not in message, message


def test_a_type_we_lack_and_a_shape_against_the_metadata_are_one_line_errors(tmp_path):
    import gguf
    import numpy as np

    from engine.model_loader.gguf_file import GGUFFile

    source = GGUFFile(FIXTURES / "tiny-llama-Q8_0.gguf")
    for case in ("type", "shape"):
        path = tmp_path / f"{case}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        for key, value in source.metadata.items():
            if key.startswith("llama.") or key == "general.name":
                _add_metadata(writer, key, value)
        for name, info in source.tensors.items():
            raw = source.raw(name)
            if len(info.shape) == 1:
                raw = raw.reshape(-1)
            shape = list(info.shape)
            ggml_type = info.ggml_type
            if name == "blk.0.attn_q.weight" and case == "type":
                ggml_type = gguf.GGMLQuantizationType.IQ2_XXS  # 66 bytes per 256 weights
                raw = np.zeros((shape[0], shape[1] // 256 * 66), dtype=np.uint8)
            if name == "blk.1.ffn_up.weight" and case == "shape":
                raw, shape = raw[:-32], [shape[0] - 32, shape[1]]
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=ggml_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(ModelSourceError) as excinfo:
            resolve_model(str(path), cache_dir=tmp_path / "cache")
        message = str(excinfo.value)
        assert "\n" not in message
        if case == "type":
            assert "'blk.0.attn_q.weight'" in message and "IQ2_XXS" in message, message
        else:
            assert "'blk.1.ffn_up.weight'" in message and "[480, 256]" in message, message


def _add_metadata(writer, key, value) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)


def test_fixtures_exist():
    """The files the tests above read are in the repository (not built at test time)."""
    assert len(ALL_FILES) >= 15
