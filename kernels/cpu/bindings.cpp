// The Python module of the C++ CPU kernels (one extension, built once per CPU).

#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, double scale);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor mins);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over a head-major paged KV cache (float32, CPU).");
  m.def("int4_linear", &int4_linear,
        "x @ W.T with W in int4 groups of 32 (float32 scales and mins).");
  m.def("int8_linear", &int8_linear, "x @ W.T with W in int8 groups of 32 (float32 scales).");
}
