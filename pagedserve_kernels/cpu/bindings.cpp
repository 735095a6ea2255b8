// The Python module of the C++ CPU kernels (one extension, built once per CPU).

// pybind.h (not torch/extension.h) is all a module of at::Tensor functions needs; the
// kernel files include only ATen/core/Tensor.h: each file then compiles in a fraction of
// the time torch/extension.h costs (docs/performance.md).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The long calls release the GIL: with --async-scheduling the scheduler thread runs
  // its Python while the worker thread is in them.
  m.def("paged_attention", &paged_attention, py::call_guard<py::gil_scoped_release>(),
        "Attention of query rows over a head-major paged KV cache, read in place (CPU); "
        "sliding_window > 0: each row sees only its last that many keys.",
        py::arg("out"), py::arg("query"), py::arg("kv_cache"), py::arg("block_table"),
        py::arg("row_tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("sliding_window") = 0);
  m.def("prefill_attention", &prefill_attention, py::call_guard<py::gil_scoped_release>(),
        "Causal attention of the last L of S positions in bfloat16 (AVX512-BF16): "
        "out/query [L, Hq, D], key/value [Hkv, S, D].",
        py::arg("out"), py::arg("query"), py::arg("key"), py::arg("value"), py::arg("scale"));
  m.def("prefill_attention_available", &prefill_attention_available,
        "Whether this build has prefill_attention's AVX512-BF16 code.");
  m.def("int4_linear", &int4_linear, py::call_guard<py::gil_scoped_release>(),
        "x @ W.T with W in int4 groups of 32 (float16 scales and mins).");
  m.def("int8_linear", &int8_linear, py::call_guard<py::gil_scoped_release>(),
        "x @ W.T with W in int8 groups of 32 (scales; blocked GGUF Q5_K: and mins).",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins") = py::none());
  m.def("set_batch_invariant", &set_batch_invariant,
        "int4/int8: every batch size takes the same per-row arithmetic (--batch-invariant).");
  m.def("set_activation_precision", &set_activation_precision,
        "Few-row int4/int8/GGUF kernels: round activations to 16 or 8 bits (8: u8 x s8 kernels).");
  m.def("activation_precision", &activation_precision,
        "The few-row kernels' activation precision in bits (16 or 8).");
  m.def("gguf_dequantize", &gguf_dequantize, py::call_guard<py::gil_scoped_release>(),
        "GGUF block-format rows [N, row_bytes] (uint8) -> float32 [N, K].");
  m.def("gguf_linear", &gguf_linear, py::call_guard<py::gil_scoped_release>(),
        "x @ W.T with W in a GGUF block format (few rows: integer/row kernels; more: tiles).");
  m.def("quant_tiled_linear", &quant_tiled_linear, py::call_guard<py::gil_scoped_release>(),
        "x @ W.T for int4/int8 weights, decoded a tile at a time into x's dtype (many rows).");
  m.def("blocked_rows", &blocked_rows, py::call_guard<py::gil_scoped_release>(),
        "Rows ids of a blocked int4/int8 weight as float32 [R, K] (embedding lookups).");
  m.def("rms_norm", &rms_norm, "out = weight * x / sqrt(mean(x^2) + eps), row by row.");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual), in place.");
  m.def("rotary_neox_", &rotary_neox_, "RoPE (neox halves) on q and k, in place.");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:].");
  m.def("lora_add_", &lora_add_, py::call_guard<py::gil_scoped_release>(),
        "The LoRA side path of one linear, every adapter group of the step (lora.cpp).");
  m.def("write_kv_cache", &write_kv_cache,
        "key/value [T, Hkv, D] into their slots of the head-major paged cache (-1 skipped).");

  py::class_<LinearWeights>(m, "LinearWeights")
      .def(py::init<>())
      .def_readwrite("dense", &LinearWeights::dense)
      .def_readwrite("bias", &LinearWeights::bias)
      .def_readwrite("data", &LinearWeights::data)
      .def_readwrite("scales", &LinearWeights::scales)
      .def_readwrite("mins", &LinearWeights::mins)
      .def_readwrite("quant_bits", &LinearWeights::quant_bits)
      .def_readwrite("quant_max_rows", &LinearWeights::quant_max_rows)
      .def_readwrite("gguf_type", &LinearWeights::gguf_type)
      .def_readwrite("parts", &LinearWeights::parts);
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init<>())
      .def_readwrite("input_norm", &LayerWeights::input_norm)
      .def_readwrite("post_attention_norm", &LayerWeights::post_attention_norm)
      .def_readwrite("q_norm", &LayerWeights::q_norm)
      .def_readwrite("k_norm", &LayerWeights::k_norm)
      .def_readwrite("qkv", &LayerWeights::qkv)
      .def_readwrite("o", &LayerWeights::o)
      .def_readwrite("gate_up", &LayerWeights::gate_up)
      .def_readwrite("down", &LayerWeights::down);
  py::class_<DecoderShape>(m, "DecoderShape")
      .def(py::init<>())
      .def_readwrite("num_heads", &DecoderShape::num_heads)
      .def_readwrite("num_kv_heads", &DecoderShape::num_kv_heads)
      .def_readwrite("head_size", &DecoderShape::head_size)
      .def_readwrite("rms_norm_eps", &DecoderShape::rms_norm_eps)
      .def_readwrite("attention_scale", &DecoderShape::attention_scale);
  py::class_<LoRAWeights>(m, "LoRAWeights")
      .def(py::init<>())
      .def_readwrite("a", &LoRAWeights::a)
      .def_readwrite("b_t", &LoRAWeights::b_t)
      .def_readwrite("pieces", &LoRAWeights::pieces);
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<std::vector<LayerWeights>, DecoderShape>())
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>(),
           "A step's decoder layers: (hidden, cos, sin, kv_caches, slot_mapping, block_table, "
           "row_tables, seq_lens, lora_ids, lora_rows) -> (last MLP output, residual stream).")
      .def("set_lora", &DecoderStack::set_lora,
           "An adapter's matrices on one linear (0 qkv, 1 o, 2 gate_up, 3 down) of a layer.")
      .def("drop_lora", &DecoderStack::drop_lora, "Forget an adapter's matrices.");
}
