"""Weight-only int4/int8 linears: the C++ kernels against their torch reference, exact
GGUF Q4_0/Q4_1/Q8_0 round trips, and greedy parity of quantized models with
transformers run on the same (dequantized-back) weights."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

import pagedserve_kernels.cpu_kernels
from engine import LLM, SamplingParams
from engine.model_loader import load_model, resolve_model
from engine.models.layers import Linear, MergedLinear
from engine.models.quant import (
    KERNEL_CALLS,
    QuantSpec,
    block_int4,
    block_int8,
    default_max_rows,
    kernel_kind,
    pack_int4,
    quantize,
    unblock_int4,
    unblock_int8,
    unpack_int4,
)
from engine.models.weight_utils import map_weight_name
from pagedserve_kernels.reference import quant_linear_ref
from tests.support.hf_reference import assert_greedy_matches, hf_greedy_reference
from tests.support.model_fixtures import build_tiny_checkpoint, build_tiny_gguf

needs_kernels = pytest.mark.skipif(not pagedserve_kernels.cpu_kernels.toolchain_available(),
                                   reason="no C++ compiler/ninja to build the CPU kernels")
SPECS = [QuantSpec("int4"), QuantSpec("int4", symmetric=True), QuantSpec("int8")]
# How far apart two tokens' logprobs may be for a flip between them to count as a
# near-tie: a tenth of the tiny models' logit spread.
NEAR_TIE_LOGPROB_GAP = 0.16
PROMPTS = [[1, 5, 9, 13, 17, 21], [2, 4, 6], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 30, 31], [100]]


def test_pack_int4_layout_and_round_trip():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).view(1, 64)
    packed = pack_int4(q)
    assert packed.shape == (1, 32)
    # group 0: byte j = q[j] | q[j + 16] << 4, with q[j + 16] = j
    assert packed[0, 1].item() == 0x11 and packed[0, 15].item() == 0xFF
    random = torch.randint(0, 16, (48, 96), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(random)), random)


@pytest.mark.parametrize("ggml_type,spec", [
    (gguf.GGMLQuantizationType.Q4_1, QuantSpec("int4")),
    (gguf.GGMLQuantizationType.Q4_0, QuantSpec("int4", symmetric=True)),
    (gguf.GGMLQuantizationType.Q8_0, QuantSpec("int8")),
])
def test_gguf_grid_values_requantize_exactly(ggml_type, spec):
    """A dequantized GGUF tensor, quantized again, gives back the same values."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((64, 128)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    values = torch.from_numpy(dequantize(gguf_quantize(weight, ggml_type), ggml_type).copy())
    again = quantize(values, spec, max_rows=0).dequantized()
    torch.testing.assert_close(again, values, atol=1e-6, rtol=1e-6)


@needs_kernels
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("num_rows,out_features,in_features",
                         [(1, 48, 64), (3, 100, 96), (16, 64, 320), (40, 16, 32), (13, 40, 96),
                          # two 8-row blocks and 3 left over; 37 outputs: a partial output tile
                          (19, 37, 96),
                          # three and four blocks, 3 rows left over, K = 1536 (48 groups)
                          (27, 37, 96), (32, 24, 1536),
                          # one row: int4 takes dot_rows_int4 -- blocks of 8 groups, a
                          # leftover pair, an odd last group
                          (1, 20, 96), (1, 33, 320), (1, 17, 576), (1, 8, 32)])
def test_kernel_matches_torch_reference(spec, num_rows, out_features, in_features):
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features) * 0.1
    weight[0, :32] = 0.0  # an all-zero group
    qw = quantize(weight, spec, max_rows=1 << 20)
    x = torch.randn(num_rows, in_features)
    bias = torch.randn(out_features)
    # The kernel's own arithmetic (activations rounded to int16 per group of 32) ...
    data, scales, mins = qw.canonical()
    # weights with a multiple of 16 outputs are held in blocks of 16 (quant_blocked.cpp)
    assert qw.blocked == (out_features % 16 == 0)
    q = unpack_int4(data) if spec.method == "int4" else data
    exact = quant_linear_ref(x, q, scales, mins) + bias
    torch.testing.assert_close(qw.matmul(x, bias), exact, atol=1e-5, rtol=1e-5)
    # ... which differs from the float product with the dequantized weight by at most
    # the activation rounding: half a step dx / 2 per element, times |w|.
    dense = torch.nn.functional.linear(x, qw.dequantized(), bias)
    half_steps = (x.view(num_rows, -1, 32).abs().amax(-1, keepdim=True) / 65534).expand(
        -1, -1, 32).reshape(num_rows, in_features)
    bound = half_steps @ qw.dequantized().abs().T + 1e-5
    assert ((qw.matmul(x, bias) - dense).abs() <= bound).all()
    # bfloat16 activations go through the same kernel and come back in bfloat16
    out_bf16 = qw.matmul(x.bfloat16(), None)
    assert out_bf16.dtype == torch.bfloat16
    # and quantization is close to the original weight (half a step per value)
    step = (weight.abs().max() / (7 if spec.method == "int4" else 127)).item()
    assert (qw.dequantized() - weight).abs().max().item() <= step


@needs_kernels
def test_kernel_rejects_bad_inputs():
    module = pagedserve_kernels.cpu_kernels.cpu_kernels()
    qw = quantize(torch.randn(16, 64), QuantSpec("int4"), max_rows=8)
    with pytest.raises(RuntimeError, match="columns"):
        module.int4_linear(torch.randn(2, 32), qw.data, qw.scales, qw.mins)
    with pytest.raises(RuntimeError, match="float32"):
        module.int4_linear(torch.randn(2, 64).double(), qw.data, qw.scales, qw.mins)
    with pytest.raises(RuntimeError, match="mins"):
        module.int4_linear(torch.randn(2, 64), qw.data, qw.scales, qw.mins[:, :1].contiguous())
    data, scales, mins = qw.canonical()  # the row-major layout's own checks
    with pytest.raises(RuntimeError, match="mins"):
        module.int4_linear(torch.randn(2, 64), data, scales, mins[:, :1].contiguous())


def test_blocked_int4_layout_worked_example_and_round_trip():
    # Every row's group 0 starts q = (1, 2, 3, 4): block 0 begins 0x31 0x42 (row 0), ...
    q = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    q[:, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    scales = torch.rand(32, 2).half()
    mins = -torch.rand(32, 2).half()
    blocked, bscales, bmins = block_int4(pack_int4(q), scales, mins)
    assert blocked.shape == (2, 2, 256) and bscales.shape == (2, 2, 16)
    assert blocked[0, 0, :4].tolist() == [0x31, 0x42, 0x31, 0x42]
    assert torch.equal(bscales[1, 0], scales[16:32, 0])  # lane j = row 16 b + j
    data, s2, m2 = unblock_int4(blocked, bscales, bmins)
    assert torch.equal(unpack_int4(data), q) and torch.equal(s2, scales) and torch.equal(m2, mins)
    ids = torch.tensor([31, 0, 17])
    data, s2, _ = unblock_int4(blocked, bscales, bmins, ids)
    assert torch.equal(unpack_int4(data), q[ids]) and torch.equal(s2, scales[ids])


def test_blocked_int8_layout_worked_example_and_round_trip():
    # Every row's group 0 starts q = (1, -2, 3, 4): block 0, group 0 begins with pair 0
    # of rows 0..15 (1 -2 1 -2 ...), then pair 1 (3 4 3 4 ...).
    q = torch.randint(-128, 128, (32, 64), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(1))
    q[:, :4] = torch.tensor([1, -2, 3, 4], dtype=torch.int8)
    q[5, 2:4] = torch.tensor([-128, 127], dtype=torch.int8)  # row 5's pair 1
    scales = torch.rand(32, 2).half()
    blocked, bscales = block_int8(q, scales)
    assert blocked.shape == (2, 2, 512) and blocked.dtype == torch.int8
    assert bscales.shape == (2, 2, 16)
    assert blocked[0, 0, :4].tolist() == [1, -2, 1, -2]
    assert blocked[0, 0, 32:36].tolist() == [3, 4, 3, 4]
    assert blocked[0, 0, 32 + 10:32 + 12].tolist() == [-128, 127]  # lane 5 of pair 1
    # block 1, group 1, pair 3, lane 2: row 18, column 32 + 6
    assert blocked[1, 1, 3 * 32 + 2 * 2].item() == q[18, 38].item()
    assert torch.equal(bscales[1, 0], scales[16:32, 0])  # lane j = row 16 b + j
    data, s2 = unblock_int8(blocked, bscales)
    assert torch.equal(data, q) and torch.equal(s2, scales)
    ids = torch.tensor([31, 0, 17, 17])
    data, s2 = unblock_int8(blocked, bscales, ids)
    assert torch.equal(data, q[ids]) and torch.equal(s2, scales[ids])


def test_blocked_int8_weight_reads_back_its_rows():
    """canonical / dequantize_rows (the tied embedding's lookup) see the row-major values."""
    weight = torch.randn(48, 96)
    qw = quantize(weight, QuantSpec("int8"), max_rows=0)
    assert qw.blocked and kernel_kind(qw.spec, 48) == "int8-blocked"
    row_major = quantize(weight[:40], qw.spec)  # 40 outputs: no whole blocks, not blocked
    assert kernel_kind(qw.spec, 40) == "int8" and not row_major.blocked
    data, scales, mins = qw.canonical()
    assert mins is None and data.shape == (48, 96) and scales.shape == (48, 3)
    assert torch.equal(data[:40], row_major.data) and torch.equal(scales[:40], row_major.scales)
    ids = torch.tensor([47, 3, 16, 3])
    data_ids, scales_ids, _ = qw.canonical(ids)
    assert torch.equal(data_ids, data[ids]) and torch.equal(scales_ids, scales[ids])
    values = data.float().view(48, 3, 32) * scales.float().unsqueeze(-1)
    assert torch.equal(qw.dequantize_rows(ids), values.view(48, 96)[ids])
    assert torch.equal(qw.dequantized(), values.view(48, 96))


@needs_kernels
def test_blocked_int8_matches_the_reference_on_both_sides_of_max_rows():
    """Few-row blocked kernel up to max_rows, the tiled path (decoding the blocked layout)
    above it: both against the row-major layout's reference."""
    torch.manual_seed(5)
    max_rows = default_max_rows("int8-blocked")
    qw = quantize(torch.randn(64, 160) * 0.1, QuantSpec("int8"))
    assert qw.blocked and qw.max_rows == max_rows
    data, scales, _ = qw.canonical()
    dense = qw.dequantized()
    for rows in sorted({1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, max(max_rows, 1),
                        max_rows + 1}):
        x = torch.randn(rows, 160)
        path = "int8" if qw.serves(rows) else "tiled"
        before = KERNEL_CALLS[path]
        out = qw.matmul(x, None)
        assert KERNEL_CALLS[path] == before + 1
        if path == "int8":
            torch.testing.assert_close(out, quant_linear_ref(x, data, scales, None),
                                       atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(out, x @ dense.T, atol=1e-4, rtol=1e-4)
    module = pagedserve_kernels.cpu_kernels.cpu_kernels()
    with pytest.raises(RuntimeError, match="scales"):
        module.int8_linear(torch.randn(2, 160), qw.data, scales)  # row-major scales
    with pytest.raises(RuntimeError, match="columns"):
        module.int8_linear(torch.randn(2, 128), qw.data, qw.scales)


@needs_kernels
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_blocked_rows_do_not_depend_on_their_batch(spec):
    torch.manual_seed(3)
    qw = quantize(torch.randn(48, 256) * 0.1, spec, max_rows=1 << 20)
    assert qw.blocked
    x = torch.randn(15, 256)  # a pass of 8 rows and one of 7
    together = qw.matmul(x, None)
    for m in (0, 7, 8, 14):
        assert torch.equal(qw.matmul(x[m:m + 1], None)[0], together[m])
    for rows in range(2, 8):  # the leftover passes of 2 .. 7 rows
        assert torch.equal(qw.matmul(x[:rows], None), together[:rows])


@needs_kernels
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("out_features", [48, 40], ids=["blocked", "row-major"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rows_are_the_float32_result_rounded(spec, out_features, dtype):
    """bfloat16 / float16 x: the float32 call on x widened, rounded once to x's dtype
    (bitwise), on the blocked kernels (which do it inside) and the row-major ones, with
    either activation precision."""
    torch.manual_seed(4)
    qw = quantize(torch.randn(out_features, 256) * 0.1, spec, max_rows=1 << 20)
    assert qw.blocked == (out_features % 16 == 0)
    ck = pagedserve_kernels.cpu_kernels
    linear = ck.cpu_kernels().int4_linear if spec.method == "int4" else ck.cpu_kernels().int8_linear
    before = ck.activation_precision()
    try:
        for precision in ("int16", "int8"):
            ck.set_activation_precision(precision)
            for rows in (1, 3, 9):
                x = torch.randn(rows, 256).to(dtype)
                out = linear(x, qw.data, qw.scales, qw.mins)
                assert out.dtype == dtype
                widened = linear(x.float(), qw.data, qw.scales, qw.mins)
                assert torch.equal(out, widened.to(dtype))
    finally:
        ck.set_activation_precision(before)


def test_quantized_linear_drops_its_dense_weight_and_serves_every_batch():
    layer = Linear(64, 32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64))
    assert layer.quantize(QuantSpec("int8"), max_rows=4)
    assert layer.weight.numel() == 0  # no dense shadow beside the int8 weight
    weight = layer.quantized.dequantized()
    for rows, path in ((4, "int8"), (5, "tiled")):
        if not layer.quantized.serves(1):  # no C++ kernels: the torch fallback
            break
        before = KERNEL_CALLS[path]
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-3, atol=2e-3)  # int16 x
        assert KERNEL_CALLS[path] == before + 1
    assert not Linear(40, 16).quantize(QuantSpec("int4"))  # K not a multiple of 32


def export_dense_checkpoint(model, source_dir, out_dir):
    """Save a HF checkpoint of `source_dir`'s model with our (dequantized) dense weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32)
    ours = dict(model.named_parameters())
    for name, module in model.named_modules():  # packed weights: their dequantized values
        packed = getattr(module, "quantized", None) or getattr(module, "packed", None)
        if packed is not None:
            ours[f"{name}.weight"] = packed.dequantized()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            target, shard = map_weight_name(name)
            if target.startswith("lm_head.") and target not in ours:
                target = "model.embed_tokens.weight"  # tied
            value = ours[target]
            if shard is not None:
                merged = model.get_submodule(target.rpartition(".")[0])
                assert isinstance(merged, MergedLinear)
                value = value.narrow(0, merged.offsets[shard], merged.output_sizes[shard])
            param.copy_(value)
    hf.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(source_dir).save_pretrained(out_dir)
    return out_dir


def greedy_tokens(model_dir, quantization: str, max_tokens: int) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", quantization=quantization, max_model_len=256)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@needs_kernels
@pytest.mark.parametrize("arch,method", [("llama", "int4"), ("qwen3", "int8")])
def test_quantized_tiny_model_matches_transformers_on_dequantized_weights(tmp_path, arch,
                                                                          method):
    model_dir = build_tiny_checkpoint(tmp_path / "hf", arch, tie_word_embeddings=True)
    ours = load_model(model_dir, torch.float32, "cpu", method)
    report = ours.quantization_report
    assert "lm_head" in report.specs and not report.dense_modules
    reference_dir = export_dense_checkpoint(ours, model_dir, tmp_path / "dequantized")
    before = KERNEL_CALLS[method]
    max_tokens = 16
    got = greedy_tokens(model_dir, method, max_tokens)
    # Every decode step (4 rows) ran every linear through the quantized kernel.
    assert KERNEL_CALLS[method] - before >= len(report.specs) * (max_tokens - 1)
    reference = hf_greedy_reference(reference_dir, PROMPTS, max_tokens, ignore_eos=True)
    # At most one near-tie flip, and a tie in numbers, not just a top-5 token.
    assert assert_greedy_matches(got, reference, max_gap=NEAR_TIE_LOGPROB_GAP) <= 1


@needs_kernels
def test_q4_1_gguf_is_served_in_its_own_precision(tmp_path):
    """--quantization auto: a Q4_1 GGUF runs as int4 with exactly its own values."""
    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "llama")
    gguf_path = build_tiny_gguf(hf_dir, tmp_path / "tiny.Q4_1.gguf", "llama",
                                matrix_type=gguf.GGMLQuantizationType.Q4_1)
    converted = resolve_model(gguf_path, cache_dir=tmp_path / "cache").path
    dense = load_model(converted, torch.float32, "cpu", "none")
    ours = load_model(converted, torch.float32, "cpu", "auto")
    # every 2-D weight (7 per layer, the embedding, the lm_head) repacked, exactly
    assert dict(ours.gguf_report.repacked_types) == {"Q4_1": 2 * 7 + 2}
    assert not ours.gguf_report.packed_types
    for name, module in ours.named_modules():
        if getattr(module, "quantized", None) is not None:
            assert module.quantized.spec == QuantSpec("int4") and module.weight.numel() == 0
            torch.testing.assert_close(module.quantized.dequantized(),
                                       dense.get_submodule(name).weight, atol=0, rtol=0)
    got = greedy_tokens(converted, "auto", 12)
    # transformers on the GGUF's dequantized weights (its own GGUF loader takes this tiny
    # file's vocabulary from the 400-token tokenizer, not the 512-row embedding)
    reference_dir = export_dense_checkpoint(dense, hf_dir, tmp_path / "dequantized")
    reference = hf_greedy_reference(reference_dir, PROMPTS, 12, ignore_eos=True)
    assert assert_greedy_matches(got, reference, max_gap=NEAR_TIE_LOGPROB_GAP) <= 1


@needs_kernels
def test_int8_activations_take_prefill_and_match_transformers(tmp_path):
    """--activation-precision int8 (the engine flag, set before the weights load): on AVX-512
    VNNI the blocked kernels serve every batch, 4 x 40-token prompts' prefill included (no
    tiled call; elsewhere the limits stay), and the greedy tokens of a tiny Q4_0 GGUF equal
    transformers' on its dequantized weights under the near-tie rule."""
    from engine import cpu_info
    from engine.models.quant import ALL_ROWS

    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "llama")
    gguf_path = build_tiny_gguf(hf_dir, tmp_path / "tiny.Q4_0.gguf", "llama",
                                matrix_type=gguf.GGMLQuantizationType.Q4_0)
    converted = resolve_model(gguf_path, cache_dir=tmp_path / "cache").path
    vnni = {"avx512f", "avx512bw", "avx512_vnni"} <= cpu_info.cpu_flags()
    prompts = [[(7 * i + 3 * j) % 300 + 1 for j in range(40)] for i in range(4)]
    before = pagedserve_kernels.cpu_kernels.activation_precision()
    try:
        llm = LLM(str(converted), dtype="float32", activation_precision="int8",
                  max_model_len=256)
        assert pagedserve_kernels.cpu_kernels.activation_precision() == "int8"
        calls = dict(KERNEL_CALLS)
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10,
                                                       ignore_eos=True), use_tqdm=False)
        assert KERNEL_CALLS["int4"] > calls.get("int4", 0)
        if vnni:
            assert KERNEL_CALLS["tiled"] == calls.get("tiled", 0)
        packed = load_model(converted, torch.bfloat16, "cpu", "auto")
        limits = {m.quantized.max_rows for m in packed.modules()
                  if getattr(m, "quantized", None) is not None}
        assert limits == {ALL_ROWS} if vnni else ALL_ROWS not in limits
    finally:
        pagedserve_kernels.cpu_kernels.set_activation_precision(before)
    dense = load_model(converted, torch.float32, "cpu", "none")
    reference_dir = export_dense_checkpoint(dense, hf_dir, tmp_path / "dequantized")
    reference = hf_greedy_reference(reference_dir, prompts, 10, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in outputs]
    assert_greedy_matches(ours, reference, max_gap=NEAR_TIE_LOGPROB_GAP)


@needs_kernels
@pytest.mark.parametrize("native_bf16", [True, False], ids=["avx512_bf16", "no_bf16"])
def test_few_row_limit_follows_the_model_dtype(tmp_path, monkeypatch, native_bf16):
    """The tiled path decodes into the model's dtype, so each packed weight's few-row
    limit is default_max_rows for that dtype (float32 tiles are slower: more rows stay
    on the integer kernels), and --dtype auto's limit is the one of the dtype it picks."""
    from engine import cpu_info
    from engine.model_loader.weights import auto_cpu_dtype

    flags = {"avx2", "avx512f", "avx512bw"} | ({"avx512_bf16"} if native_bf16 else set())
    monkeypatch.setattr(cpu_info, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.delenv("PAGEDSERVE_QUANT_MAX_ROWS", raising=False)
    hf_dir = build_tiny_checkpoint(tmp_path / "hf", "llama")
    gguf_path = build_tiny_gguf(hf_dir, tmp_path / "tiny.Q4_1.gguf", "llama",
                                matrix_type=gguf.GGMLQuantizationType.Q4_1)
    converted = resolve_model(gguf_path, cache_dir=tmp_path / "cache").path
    limits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(converted, dtype, "cpu", "auto")
        packed = [m.quantized for m in model.modules() if getattr(m, "quantized", None) is not None]
        assert packed
        for weight in packed:
            kind = kernel_kind(weight.spec, weight.out_features)
            assert weight.max_rows == default_max_rows(kind, dtype)
            limits[dtype, kind] = weight.max_rows
    blocked = [kind for _, kind in limits if kind.endswith("-blocked")]
    assert blocked
    for kind in blocked:
        assert limits[torch.float32, kind] >= limits[torch.bfloat16, kind]
        assert default_max_rows(kind) == default_max_rows(kind, auto_cpu_dtype()[0])
        if native_bf16:  # bfloat16 tiles multiply natively: fewer rows stay on the kernel
            assert limits[torch.float32, kind] > limits[torch.bfloat16, kind]
