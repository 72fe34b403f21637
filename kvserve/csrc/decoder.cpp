// A decode step's decoder layers in one call: the same ops the Python layers run
// (kvserve/model/llama.py), in the same order with the same roundings, minus the
// interpreter. At decode batch sizes each layer is ~10 small ops, and their Python
// dispatch (module calls, views, wrappers; ~4 ms of a 21 ms batch-1 step on SmolLM2)
// costs as much as the attention itself. Used only where every op has a kernel here:
// bf16 weights packed for small_batch_linear, rows within its limit, all attention in
// paged_attention; everything else runs the Python layers.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>
#include <vector>

#include "ops.h"

namespace kvserve {
namespace {

struct Shapes {
  int64_t tokens, heads, kv_heads, head_dim;
};

// Each kernel call is a profiler range named as its op, so `kvserve bench step --profile`
// splits the loop's time as it splits the Python layers' (free when not profiling).
#define KVSERVE_RANGE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                  bool use_amx) {
  KVSERVE_RANGE("kvserve::small_batch_linear");
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  small_batch_linear(out, x, packed, bias, use_amx);
  return out;
}

// K/V rows of the new tokens into the paged cache at their slots (block * block_size + offset).
// k, v: [T, kv_heads, D] views into the fused qkv output (rows strided, heads contiguous).
void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& cache, const int64_t* slots,
              const Shapes& s) {
  KVSERVE_RANGE("aten::index_copy_");  // what the Python layers use for it
  const int64_t slot_count = cache.size(1) * cache.size(2), row = s.kv_heads * s.head_dim;
  TORCH_CHECK(cache.is_contiguous() && cache.size(3) * cache.size(4) == row, "kv cache must be contiguous");
  TORCH_CHECK(k.stride(1) == s.head_dim && v.stride(1) == s.head_dim, "k, v: heads must be contiguous");
  auto* base = cache.data_ptr<at::BFloat16>();
  const auto* kp = k.const_data_ptr<at::BFloat16>();
  const auto* vp = v.const_data_ptr<at::BFloat16>();
  for (int64_t t = 0; t < s.tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slot_count, "slot ", slots[t], " out of range");
    std::memcpy(base + slots[t] * row, kp + t * k.stride(0), row * sizeof(at::BFloat16));
    std::memcpy(base + (slot_count + slots[t]) * row, vp + t * v.stride(0), row * sizeof(at::BFloat16));
  }
}

}  // namespace

// x [T, hidden] (embedded tokens) -> (output of the last layer's MLP, residual stream), as
// LlamaForCausalLM's layer loop returns them; the final norm stays in Python.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& x_in, const at::Tensor& cos_sin, const std::vector<at::Tensor>& input_norm,
    const std::vector<at::Tensor>& qkv, const c10::List<c10::optional<at::Tensor>>& qkv_bias,
    const std::vector<at::Tensor>& o_proj, const std::vector<at::Tensor>& post_norm,
    const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, const std::vector<at::Tensor>& kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& query_start,
    const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
    int64_t intermediate_size, double eps, double scale, bool use_amx) {
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2, "x must be bf16 [tokens, hidden]");
  for (const auto* list : {&input_norm, &qkv, &o_proj, &post_norm, &gate_up, &down})
    TORCH_CHECK(static_cast<int64_t>(list->size()) == layers, "one weight per layer");
  TORCH_CHECK(static_cast<int64_t>(qkv_bias.size()) == layers, "one qkv bias (or None) per layer");
  const int64_t hidden = x_in.size(1), head_dim = kv_caches[0].size(4);
  const Shapes s{x_in.size(0), num_heads, num_kv_heads, head_dim};
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == s.tokens, "slot_mapping: int64 [tokens]");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();

  at::Tensor x = x_in, residual, h = at::empty_like(x_in);
  for (int64_t l = 0; l < layers; ++l) {
    if (l == 0) {
      residual = x_in.clone();
      rms_norm(h, x_in, input_norm[l], eps);
    } else {
      fused_add_rms_norm(h, x, residual, input_norm[l], eps);  // residual += x
    }
    const at::Tensor fused = linear(h, qkv[l], qkv_bias.get(l), q_size + 2 * kv_size, use_amx);
    at::Tensor q = fused.narrow(1, 0, q_size).view({s.tokens, num_heads, head_dim});
    at::Tensor k = fused.narrow(1, q_size, kv_size).view({s.tokens, num_kv_heads, head_dim});
    const at::Tensor v = fused.narrow(1, q_size + kv_size, kv_size).view({s.tokens, num_kv_heads, head_dim});
    rotary_embedding(q, k, cos_sin);
    write_kv(k, v, kv_caches[l], slots, s);
    at::Tensor attn = at::empty({s.tokens, num_heads, head_dim}, x_in.options());
    {
      KVSERVE_RANGE("kvserve::paged_attention");
      paged_attention(attn, q, kv_caches[l][0], kv_caches[l][1], block_tables, query_start, query_lens, context_lens,
                      scale);
    }
    const at::Tensor o = linear(attn.view({s.tokens, q_size}), o_proj[l], c10::nullopt, hidden, use_amx);
    fused_add_rms_norm(h, o, residual, post_norm[l], eps);  // residual += o
    const at::Tensor gu = linear(h, gate_up[l], c10::nullopt, 2 * intermediate_size, use_amx);
    at::Tensor act = at::empty({s.tokens, intermediate_size}, x_in.options());
    silu_and_mul(act, gu);
    x = linear(act, down[l], c10::nullopt, hidden, use_amx);
  }
  return {x, residual};
}

}  // namespace kvserve

TORCH_LIBRARY_FRAGMENT(kvserve, m) {
  m.def(
      "decoder_layers(Tensor x, Tensor cos_sin, Tensor[] input_norm, Tensor[] qkv, Tensor?[] qkv_bias, "
      "Tensor[] o_proj, Tensor[] post_norm, Tensor[] gate_up, Tensor[] down, Tensor(a!)[] kv_caches, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start, Tensor query_lens, Tensor context_lens, "
      "int num_heads, int num_kv_heads, int intermediate_size, float eps, float scale, bool use_amx) "
      "-> (Tensor, Tensor)");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &kvserve::decoder_layers);
}
