// A dense Llama-family decoder's layers in one call: the same kernels, in the same
// order and on the same tensors as engine/models/llama.py's DecoderLayer.forward, with
// no interpreter between them. At one client a step's ~40 Python-level calls per layer
// cost as much as its int4 matmuls; here they cost a few microseconds each.
//
// Per layer (T tokens, H query heads, Hkv KV heads, D head size):
//   h, residual = rms_norm(h) , h              first layer (the stream is the input)
//   h, residual = rms_norm(h + residual), ...  later layers (add_rms_norm_, in place)
//   qkv = h @ Wqkv.T          [T, (H + 2 Hkv) D]; q, k, v are column slices of it
//   q, k = head_rms_norm(q), head_rms_norm(k)    Qwen3 only (new tensors)
//   rotary_neox_(q, k)        in place (in qkv, or in the normed copies)
//   write_kv_cache(k, v)      into this layer's paged cache at slot_mapping
//   a = paged_attention(q)    [T, H, D] over each token's cached context
//   h = a @ Wo.T ; h, residual = rms_norm(h + residual), ...
//   h = down(silu(gate) * up)  with gate | up = h @ Wgate_up.T
// With LoRA adapters in the step each of the four linears adds their side path
// (lora_add_, as engine/lora/layers.py LinearLoRA.add_to does in the modules).
#include "ops.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/rsqrt.h>

namespace {

// Linear._matmul: a packed weight's few-row kernel for batches it serves (in x's dtype, as
// gguf_linear), decoded tiles for larger ones, else the dense weight; a stacked weight is
// its parts side by side.
at::Tensor linear(const LinearWeights& w, const at::Tensor& x) {
  at::Tensor out;
  if (!w.parts.empty()) {
    std::vector<at::Tensor> outs;
    for (const LinearWeights& part : w.parts) outs.push_back(linear(part, x));
    out = at::cat(outs, 1);
  } else if (w.gguf_type >= 0) {
    out = gguf_linear(x.contiguous(), w.data, w.gguf_type, w.quant_max_rows);
  } else if (w.quant_bits != 0 && x.size(0) <= w.quant_max_rows) {
    out = w.quant_bits == 4 ? int4_linear(x.contiguous(), w.data, w.scales, w.mins)
                            : int8_linear(x.contiguous(), w.data, w.scales, w.mins);
  } else if (w.quant_bits != 0) {
    out = quant_tiled_linear(x.contiguous(), w.data, w.scales,
                             w.mins, w.quant_bits);
  } else {
    return at::linear(x, w.dense, w.bias.defined() ? c10::optional<at::Tensor>(w.bias)
                                                   : c10::optional<at::Tensor>());
  }
  return w.bias.defined() ? at::add(out, w.bias) : out;
}

// RMSNorm over each head's D values, in the torch ops of RMSNorm.forward_torch (which
// the modules run for these 3-D inputs): the same results to the bit.
at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::Tensor x32 = x.to(at::kFloat);
  const at::Tensor normed = x32.mul(at::rsqrt(x32.pow(2).mean({-1}, true).add(eps)));
  return weight.mul(normed.to(x.scalar_type()));
}

}  // namespace

void DecoderStack::set_lora(int64_t lora_id, int64_t layer, int64_t linear,
                            LoRAWeights weights) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && linear >= 0 &&
                  linear < 4,
              "decoder_stack.set_lora: layer ", layer, " linear ", linear);
  auto& per_layer = loras_[lora_id];
  per_layer.resize(layers_.size());
  per_layer[layer][linear] = std::move(weights);
}

void DecoderStack::drop_lora(int64_t lora_id) { loras_.erase(lora_id); }

void DecoderStack::add_lora(at::Tensor& out, const at::Tensor& x, size_t layer, int linear,
                            const std::vector<int64_t>& lora_ids,
                            const std::vector<at::Tensor>& lora_rows) const {
  std::vector<at::Tensor> rows, a, b_t, pieces;
  for (size_t g = 0; g < lora_ids.size(); ++g) {
    const auto found = loras_.find(lora_ids[g]);
    if (found == loras_.end()) continue;
    const LoRAWeights& w = found->second[layer][linear];
    if (!w.a.defined()) continue;  // this adapter does not adapt this linear
    rows.push_back(lora_rows[g]);
    a.push_back(w.a);
    b_t.push_back(w.b_t);
    pieces.push_back(w.pieces);
  }
  if (!a.empty()) lora_add_(out, x.contiguous(), rows, a, b_t, pieces);
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(
    at::Tensor hidden, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& kv_caches,
    at::Tensor slot_mapping, at::Tensor block_table, at::Tensor row_tables,
    at::Tensor seq_lens, const std::vector<int64_t>& lora_ids,
    const std::vector<at::Tensor>& lora_rows) const {
  const std::vector<LayerWeights>& layers = layers_;
  const DecoderShape& shape = shape_;
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(),
              "decoder_stack: hidden must be contiguous [T, hidden_size]");
  TORCH_CHECK(kv_caches.size() == layers.size(), "decoder_stack: one KV cache per layer");
  TORCH_CHECK(lora_ids.size() == lora_rows.size(), "decoder_stack: one rows tensor per adapter");
  const bool lora = !lora_ids.empty();
  const int64_t tokens = hidden.size(0);
  const int64_t q_size = shape.num_heads * shape.head_size;
  const int64_t kv_size = shape.num_kv_heads * shape.head_size;
  at::Tensor h = hidden, residual;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& layer = layers[i];
    if (i == 0) {
      residual = h;
      h = at::empty_like(residual);
      rms_norm(h, residual, layer.input_norm, shape.rms_norm_eps);
    } else {
      add_rms_norm_(h, residual, layer.input_norm, shape.rms_norm_eps);
    }
    at::Tensor qkv = linear(layer.qkv, h);
    if (lora) add_lora(qkv, h, i, 0, lora_ids, lora_rows);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, shape.num_heads, shape.head_size});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, shape.num_kv_heads, shape.head_size});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size)
                       .view({tokens, shape.num_kv_heads, shape.head_size});
    if (layer.q_norm.defined()) {
      q = head_rms_norm(q, layer.q_norm, shape.rms_norm_eps);
      k = head_rms_norm(k, layer.k_norm, shape.rms_norm_eps);
    }
    rotary_neox_(q, k, cos, sin);
    write_kv_cache(k, v, kv_caches[i], slot_mapping);
    const at::Tensor q_rows = q.contiguous();
    at::Tensor attn = at::empty_like(q_rows);
    paged_attention(attn, q_rows, kv_caches[i], block_table, row_tables,
                    seq_lens, shape.attention_scale, /*sliding_window=*/0);
    const at::Tensor o_in = attn.view({tokens, q_size});
    h = linear(layer.o, o_in);
    if (lora) add_lora(h, o_in, i, 1, lora_ids, lora_rows);
    add_rms_norm_(h, residual, layer.post_attention_norm, shape.rms_norm_eps);
    at::Tensor gate_up = linear(layer.gate_up, h);
    if (lora) add_lora(gate_up, h, i, 2, lora_ids, lora_rows);
    at::Tensor act = at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
    silu_and_mul(act, gate_up);
    h = linear(layer.down, act);
    if (lora) add_lora(h, act, i, 3, lora_ids, lora_rows);
  }
  return {h, residual};
}
