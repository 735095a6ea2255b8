// The Python module of the C++ CPU kernels (one extension, built once per CPU).

// pybind.h (not torch/extension.h) is all a module of at::Tensor functions needs; the
// kernel files include only ATen/core/Tensor.h: each file then compiles in ~15 s, not ~60.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

void paged_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                     at::Tensor block_table, at::Tensor row_tables, at::Tensor seq_lens,
                     double scale);
at::Tensor int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                          at::Tensor mins);
at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales);
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_neox_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
void silu_and_mul(at::Tensor out, at::Tensor x);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                    at::Tensor slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Attention of query rows over a head-major paged KV cache, read in place (CPU).");
  m.def("int4_linear", &int4_linear,
        "x @ W.T with W in int4 groups of 32 (float16 scales and mins).");
  m.def("int8_linear", &int8_linear, "x @ W.T with W in int8 groups of 32 (float16 scales).");
  m.def("rms_norm", &rms_norm, "out = weight * x / sqrt(mean(x^2) + eps), row by row.");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual), in place.");
  m.def("rotary_neox_", &rotary_neox_, "RoPE (neox halves) on q and k, in place.");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:].");
  m.def("write_kv_cache", &write_kv_cache,
        "key/value [T, Hkv, D] into their slots of the head-major paged cache (-1 skipped).");
}
