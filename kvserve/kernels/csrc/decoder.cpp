// A step's decoder layers in one call: the same ops the Python layers run
// (kvserve/models/llama.py), in the same order with the same roundings, minus the
// interpreter. Each layer is ~10 small ops; their Python dispatch (module calls, views,
// wrappers), and the caches it disturbs between kernels, cost ~6 ms a step on SmolLM2's
// 30 layers. Projections go to small_batch_linear up to its row limit (bf16 on
// AVX512-BF16 or AMX, fp32 on AVX2; 0 rows where it has no path) and to oneDNN's
// pre-packed matmul above it; attention to the kernels CpuPagedAttention picks:
// paged_attention, prefill_attention, SDPA for long chunks where there is no prefill path. Built
// for bf16 and fp32 models whose every projection is packed, without q/k norm.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"

namespace kvserve {
namespace {

// Each kernel call is a profiler range named as its op, so `kvserve bench step --profile`
// splits the loop's time as it splits the Python layers' (free when not profiling).
#define KVSERVE_RANGE(name) RECORD_FUNCTION(name, std::vector<c10::IValue>())

// One projection in both packings (see kvserve/layers/linear.py).
struct Linear {
  at::Tensor small;                       // [N/16, K/p, 16, p] for small_batch_linear (empty: none)
  std::optional<at::Tensor> small_bias;   // fp32
  at::Tensor onednn;                      // oneDNN's blocked layout
  std::optional<at::Tensor> bias;         // the model's dtype, for oneDNN
  int64_t out_features;
};

at::Tensor onednn_linear(const at::Tensor& x, const Linear& w) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               c10::string_view, c10::List<std::optional<at::Scalar>>,
                                               std::optional<c10::string_view>)>();
  return op.call(x, w.onednn, w.bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

// A step's intermediates, shared by its layers (the first three only where the
// projections go to kvserve's kernel).
struct Buffers {
  at::Tensor qkv, hidden, gate_up, attn, act;
};

// The attention rows SDPA computes (CpuPagedAttention's torch_prefills): one long chunk.
struct LongChunk {
  int64_t start, len, context_len;
  at::Tensor block_table;
  at::Tensor bias;  // [groups * len, context_len] additive mask; empty: no cached prefix, plain causal
};

}  // namespace

class DecoderLayers : public torch::CustomClassHolder {
 public:
  DecoderLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double eps,
                int64_t max_small_rows, bool use_amx, bool prefill_amx)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), intermediate_(intermediate_size),
        eps_(eps), max_small_rows_(max_small_rows), use_amx_(use_amx), prefill_amx_(prefill_amx) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<at::Tensor> packed,
                 std::vector<at::Tensor> onednn, std::optional<at::Tensor> qkv_small_bias,
                 std::optional<at::Tensor> qkv_bias) {
    TORCH_CHECK(packed.size() == 4 && onednn.size() == 4, "qkv, o, gate_up, down: both packings of each");
    const int64_t hidden = input_norm.size(0), q = heads_ * head_dim_, kv = kv_heads_ * head_dim_;
    layers_.push_back({input_norm, post_norm, {packed[0], qkv_small_bias, onednn[0], qkv_bias, q + 2 * kv},
                       {packed[1], std::nullopt, onednn[1], std::nullopt, hidden},
                       {packed[2], std::nullopt, onednn[2], std::nullopt, 2 * intermediate_},
                       {packed[3], std::nullopt, onednn[3], std::nullopt, hidden}});
  }

  // x [T, hidden] (embedded tokens) -> (last layer's MLP output, residual stream), as
  // LlamaForCausalLM's layer loop returns them; the final norm stays in Python. `paged`
  // and `chunks` are CpuPagedAttention's plan (block tables, query starts, query lengths,
  // context lengths) for the rows paged_attention and prefill_attention compute (chunks
  // empty: none); the long_* lists describe the chunks left to SDPA.
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x_in, at::Tensor cos_sin, std::vector<at::Tensor> kv_caches,
                                             at::Tensor slot_mapping, std::vector<at::Tensor> paged,
                                             std::vector<at::Tensor> chunks, std::vector<int64_t> long_starts,
                                             std::vector<int64_t> long_lens, std::vector<int64_t> long_context_lens,
                                             std::vector<at::Tensor> long_tables, std::vector<at::Tensor> long_bias) {
    TORCH_CHECK((x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat) && x_in.dim() == 2,
                "x must be bf16 or fp32 [tokens, hidden]");
    TORCH_CHECK(!layers_.empty() && kv_caches.size() == layers_.size(), "one KV cache per layer (and layers)");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == x_in.size(0), "slot_mapping: int64 [tokens]");
    TORCH_CHECK(paged.size() == 4 && (chunks.empty() || chunks.size() == 4), "paged, chunks: 4 tensors each");
    std::vector<LongChunk> long_chunks;
    for (size_t i = 0; i < long_starts.size(); ++i)
      long_chunks.push_back({long_starts[i], long_lens[i], long_context_lens[i], long_tables[i], long_bias[i]});
    const int64_t tokens = x_in.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));

    at::Tensor x = x_in, residual = x_in.clone(), h = at::empty_like(x_in);
    // One set of buffers for every layer's intermediates instead of ~6 allocations a
    // layer: on a busy heap malloc walked its bins for each (3% of a decode-heavy run
    // under perf). The down projection's output (the next layer's x) and o share one:
    // each is consumed by the norm that follows it before the other is written.
    auto out_of = [&](const Linear& w) {  // oneDNN returns its own
      return tokens <= max_small_rows_ ? at::empty({tokens, w.out_features}, x_in.options()) : at::Tensor();
    };
    const Layer& first = layers_.front();
    const Buffers buf{out_of(first.qkv), out_of(first.o), out_of(first.gate_up),
                      at::empty({tokens, heads_, head_dim_}, x_in.options()),
                      at::empty({tokens, intermediate_}, x_in.options())};
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& w = layers_[l];
      if (l == 0) {
        rms_norm(h, x_in, w.input_norm, eps_);
      } else {
        fused_add_rms_norm(h, x, residual, w.input_norm, eps_);  // residual += x
      }
      const at::Tensor fused = linear(h, w.qkv, buf.qkv);
      at::Tensor q = fused.narrow(1, 0, q_size).view({tokens, heads_, head_dim_});
      at::Tensor k = fused.narrow(1, q_size, kv_size).view({tokens, kv_heads_, head_dim_});
      const at::Tensor v = fused.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads_, head_dim_});
      rotary_embedding(q, k, cos_sin);
      {
        KVSERVE_RANGE("kvserve::write_kv");
        write_kv(k, v, kv_caches[l], slot_mapping);
      }
      at::Tensor attn = buf.attn;
      if (paged[2].numel() > 0) {
        KVSERVE_RANGE("kvserve::paged_attention");
        paged_attention(attn, q, kv_caches[l][0], kv_caches[l][1], paged[0], paged[1], paged[2], paged[3], scale, 0);
      }
      if (!chunks.empty()) {
        KVSERVE_RANGE("kvserve::prefill_attention");
        prefill_attention(attn, q, kv_caches[l][0], kv_caches[l][1], chunks[0], chunks[1], chunks[2], chunks[3],
                          scale, 0, prefill_amx_);  // the layer loop runs full-attention (Llama) layers only
      }
      for (const LongChunk& c : long_chunks) long_chunk_attention(attn, q, k, v, kv_caches[l], c);
      const at::Tensor o = linear(attn.view({tokens, q_size}), w.o, buf.hidden);
      fused_add_rms_norm(h, o, residual, w.post_norm, eps_);  // residual += o
      const at::Tensor gu = linear(h, w.gate_up, buf.gate_up);
      at::Tensor act = buf.act;
      silu_and_mul(act, gu);
      x = linear(act, w.down, buf.hidden);
    }
    return {x, residual};
  }

 private:
  // x W^T (+ bias): into `out` ([rows, N], allocated by forward) by kvserve's kernel up to
  // its row limit, else a new tensor from oneDNN.
  at::Tensor linear(const at::Tensor& x, const Linear& w, at::Tensor out) const {
    if (x.size(0) > max_small_rows_) {
      KVSERVE_RANGE("mkldnn::_linear_pointwise");
      return onednn_linear(x, w);
    }
    KVSERVE_RANGE("kvserve::small_batch_linear");
    small_batch_linear(out, x, w.small, w.small_bias, use_amx_);
    return out;
  }

  // TorchAttention._prefill for one chunk, into its rows of attn.
  void long_chunk_attention(at::Tensor& attn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cache, const LongChunk& c) const {
    KVSERVE_RANGE("aten::scaled_dot_product_attention");
    // CpuPagedAttention leaves no chunk to SDPA where the cache holds another dtype (it reads pages as stored)
    TORCH_CHECK(cache.scalar_type() == q.scalar_type(), "a long chunk's SDPA reads a cache of q's dtype only");
    const at::Tensor rows = q.narrow(0, c.start, c.len).transpose(0, 1).unsqueeze(0);  // [1, Hq, n, D]
    at::Tensor o;
    if (c.bias.numel() == 0) {  // no cached prefix: the new K/V are the whole context
      const at::Tensor keys = k.narrow(0, c.start, c.len).transpose(0, 1).unsqueeze(0);
      const at::Tensor values = v.narrow(0, c.start, c.len).transpose(0, 1).unsqueeze(0);
      o = at::scaled_dot_product_attention(rows, keys, values, std::nullopt, 0.0, true, std::nullopt, true)[0];
    } else {  // query heads folded into rows per KV head, additive mask (see TorchAttention)
      const int64_t groups = heads_ / kv_heads_;
      const at::Tensor folded = rows.reshape({1, kv_heads_, groups * c.len, head_dim_});
      auto gather = [&](const at::Tensor& side) {  // [blocks, bs, H, D] -> [1, H, context, D]
        return side.index_select(0, c.block_table).flatten(0, 1).transpose(0, 1).narrow(1, 0, c.context_len).unsqueeze(0);
      };
      o = at::scaled_dot_product_attention(folded, gather(cache[0]), gather(cache[1]), c.bias)
              .view({heads_, c.len, head_dim_});
    }
    attn.narrow(0, c.start, c.len).copy_(o.transpose(0, 1));
  }

  int64_t heads_, kv_heads_, head_dim_, intermediate_;
  double eps_;
  int64_t max_small_rows_;
  bool use_amx_;      // the small-batch kernel's tiles
  bool prefill_amx_;  // prefill_attention's tiles: the path the Python layers' backend takes
  std::vector<Layer> layers_;
};

// The class's methods are listed beside it; torch_bindings.cpp calls this.
void register_decoder_layers(torch::Library& m) {
  m.class_<DecoderLayers>("DecoderLayers")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, int64_t, bool, bool>())
      .def("add_layer", &DecoderLayers::add_layer)
      .def("forward", &DecoderLayers::forward);
}

}  // namespace kvserve
