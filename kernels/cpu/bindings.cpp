// The Python module of the C++ CPU kernels (one extension, built once per CPU).

#include <torch/extension.h>

void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                     torch::Tensor block_table, torch::Tensor row_tables, torch::Tensor seq_lens,
                     double scale);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor mins);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps);
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_neox_(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
void silu_and_mul(torch::Tensor out, torch::Tensor x);
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor kv_cache,
                    torch::Tensor slot_mapping);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Attention of query rows over a head-major paged KV cache, read in place (CPU).");
  m.def("int4_linear", &int4_linear,
        "x @ W.T with W in int4 groups of 32 (float32 scales and mins).");
  m.def("int8_linear", &int8_linear, "x @ W.T with W in int8 groups of 32 (float32 scales).");
  m.def("rms_norm", &rms_norm, "out = weight * x / sqrt(mean(x^2) + eps), row by row.");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual), in place.");
  m.def("rotary_neox_", &rotary_neox_, "RoPE (neox halves) on q and k, in place.");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :I]) * x[:, I:].");
  m.def("write_kv_cache", &write_kv_cache,
        "key/value [T, Hkv, D] into their slots of the head-major paged cache (-1 skipped).");
}
