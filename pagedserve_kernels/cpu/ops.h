// The C++ CPU kernels' entry points, as bindings.cpp exposes them to Python and
// decoder_stack.cpp calls them one after another (see each .cpp for its contract).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <tuple>
#include <unordered_map>
#include <vector>

// paged_attention.cpp
void paged_attention(at::Tensor out, at::Tensor query, at::Tensor kv_cache,
                     at::Tensor block_table, at::Tensor row_tables, at::Tensor seq_lens,
                     double scale, int64_t sliding_window);
// prefill_attention.cpp (AVX512-BF16 builds; prefill_attention_available() says)
bool prefill_attention_available();
void prefill_attention(at::Tensor out, at::Tensor query, at::Tensor key, at::Tensor value,
                       double scale);
// quant_linear.cpp: x [M, K] float32, bfloat16 or float16 -> [M, N] in x's dtype (computed
// in float32 and rounded once, as a float32 call followed by Tensor.to).
at::Tensor int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales, at::Tensor mins);
// int8: `mins` (blocked only, GGUF Q5_K: w = scale q + min) may be absent.
at::Tensor int8_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales,
                       c10::optional<at::Tensor> mins);
void set_batch_invariant(bool enabled);
// The few-row kernels' activation precision, 16 or 8 bits (group32_activations.h): every
// int4/int8/GGUF few-row call reads it when it starts.
void set_activation_precision(int64_t bits);
int64_t activation_precision();
// quant_blocked.cpp (int4 / int8 in blocks of 16 output rows: uint8 [N / 16, K / 32, 256]
// / int8 [N / 16, K / 32, 512]; is_blocked tells them from quant_linear.cpp's layouts)
bool is_blocked(const at::Tensor& packed);
// Whether an int8 weight's `mins` are given (an undefined or empty tensor: none).
bool has_mins(const at::Tensor& mins);
// The layout, scales and (int4) mins of a blocked weight of `bits` 4 or 8; an error if wrong.
void check_blocked_weight(const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& mins, int64_t bits);
at::Tensor blocked_int4_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                               at::Tensor mins);
at::Tensor blocked_int8_linear(at::Tensor x, at::Tensor packed, at::Tensor scales,
                               at::Tensor mins);  // mins undefined or empty: none
void decode_blocked_int4(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst);
void decode_blocked_int8(const at::Tensor& packed, const at::Tensor& scales,
                         const at::Tensor& mins, int64_t block, float* dst);
// gguf_linear.cpp
at::Tensor gguf_dequantize(at::Tensor raw, int64_t type, int64_t cols);
at::Tensor gguf_linear(at::Tensor x, at::Tensor raw, int64_t type, int64_t max_rows);
at::Tensor quant_tiled_linear(at::Tensor x, at::Tensor data, at::Tensor scales, at::Tensor mins,
                              int64_t bits);
at::Tensor blocked_rows(at::Tensor data, at::Tensor scales, at::Tensor mins, at::Tensor ids,
                        int64_t bits);
// fused_ops.cpp
void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps);
void add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_neox_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
void silu_and_mul(at::Tensor out, at::Tensor x);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor kv_cache,
                    at::Tensor slot_mapping);

// lora.cpp: out[rows_g] += (x[rows_g] A_g^T) B_g^T for each adapter group g, piece by
// piece (b_g holds B^T [r, columns]; pieces_g [P, 2]: first output column, columns);
// rows_g empty: every row.
void lora_add_(at::Tensor out, at::Tensor x, std::vector<at::Tensor> rows,
               std::vector<at::Tensor> a, std::vector<at::Tensor> b,
               std::vector<at::Tensor> pieces);

// decoder_stack.cpp: a dense Llama-family decoder's layers in one call.

// One linear as engine.models.layers.Linear holds it. `dense` is the float weight [N, K]
// of an unquantized linear; `quant_bits` 4 or 8 with `data`/`scales`/`mins` as
// QuantizedWeight holds them; or `gguf_type` (a GGML type id, -1 for none) with `data`
// the GGUF rows as GGUFWeight holds them; quantized weights take their few-row kernel up
// to `quant_max_rows` rows and decoded tiles above. A StackedWeight is `parts`, each its
// own format, whose outputs sit side by side. `bias` undefined when the linear has none.
struct LinearWeights {
  at::Tensor dense, bias, data, scales, mins;
  int64_t quant_bits = 0;
  int64_t quant_max_rows = 0;
  int64_t gguf_type = -1;
  std::vector<LinearWeights> parts;
};

// One DecoderLayer: the two RMSNorm weights, the per-head q/k RMSNorm weights (Qwen3;
// undefined for models without them) and the four linears.
struct LayerWeights {
  at::Tensor input_norm, post_attention_norm, q_norm, k_norm;
  LinearWeights qkv, o, gate_up, down;
};

struct DecoderShape {
  int64_t num_heads = 0, num_kv_heads = 0, head_size = 0;
  double rms_norm_eps = 1e-6, attention_scale = 1.0;
};

// One LoRA adapter on one linear, in lora_add_'s layout (A stacked, B^T, pieces).
struct LoRAWeights {
  at::Tensor a, b_t, pieces;
};

// The layers of one model, built once after its weights are loaded (and quantized).
class DecoderStack {
 public:
  DecoderStack(std::vector<LayerWeights> layers, DecoderShape shape)
      : layers_(std::move(layers)), shape_(shape) {}

  // hidden [T, hidden_size] contiguous, in the weights' dtype (the embeddings; may be
  // overwritten) ->
  // (the last layer's MLP output, the residual stream), as the Python layers return
  // them. cos/sin [T, rotary_dim] float32; kv_caches: each layer's paged cache;
  // slot_mapping int64 [T]; block_table, row_tables, seq_lens: the in-place attention
  // kernel's arguments with every token of the step one kernel row.
  // lora_ids / lora_rows: the step's adapter groups (engine/lora/layers.py LoRAMapping:
  // rows empty for a group of every token), empty for a step of the base only; each
  // linear adds the side path of the groups whose adapter set_lora gave it.
  std::tuple<at::Tensor, at::Tensor> forward(
      at::Tensor hidden, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& kv_caches,
      at::Tensor slot_mapping, at::Tensor block_table, at::Tensor row_tables,
      at::Tensor seq_lens, const std::vector<int64_t>& lora_ids,
      const std::vector<at::Tensor>& lora_rows) const;

  // An adapter's matrices on linear `linear` (0 qkv, 1 o, 2 gate_up, 3 down) of `layer`
  // (tensors shared, not copied); drop_lora forgets every linear's.
  void set_lora(int64_t lora_id, int64_t layer, int64_t linear, LoRAWeights weights);
  void drop_lora(int64_t lora_id);

 private:
  // out += the side path of linear `linear` of `layer` for each group whose adapter has it.
  void add_lora(at::Tensor& out, const at::Tensor& x, size_t layer, int linear,
                const std::vector<int64_t>& lora_ids,
                const std::vector<at::Tensor>& lora_rows) const;

  std::vector<LayerWeights> layers_;
  DecoderShape shape_;
  // lora_id -> per layer, the four linears' matrices (undefined: not adapted).
  std::unordered_map<int64_t, std::vector<std::array<LoRAWeights, 4>>> loras_;
};
