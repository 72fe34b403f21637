// kvserve's CPU ops: every function torch_bindings.cpp registers, and those the files
// call of each other's (decoder.cpp runs whole layers).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace kvserve {

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& out, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos_sin);
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, double scale, int64_t window);
// paged_attention's and prefill_attention's checks of the shared arguments (int64 tables,
// starts and lengths, int32 context lengths).
void check_attention_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& query_start,
                            const at::Tensor& query_lens, const at::Tensor& context_lens);
// t as a contiguous tensor of dtype s: t itself when it already is (the model runner's
// int64 / int32 plans and block ids), without the dispatcher's round trips of
// `.to(s).contiguous()`.
inline at::Tensor as_contiguous(const at::Tensor& t, at::ScalarType s) {
  return t.scalar_type() == s && t.is_contiguous() ? t : t.to(s).contiguous();
}
// The new tokens' K/V into the cache at their slots, as it stores them (copied, rounded to bf16,
// or quantized to int8 rows: write_kv.cpp).
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping);
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, double scale, int64_t window, bool use_amx);
std::vector<int64_t> supported_head_dims();
std::string vector_isa();
void small_batch_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias, bool use_amx);
void small_batch_argmax(at::Tensor& token_ids, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& banned, bool use_amx);
std::string small_batch_linear_isa();
// small_batch_linear's fp32 path (AVX2 and FMA); bias: fp32 [N] or null.
void small_batch_linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias);
// small_batch_argmax's fp32 path: thread t keeps each row's per-lane maxima and their
// columns in best / index [t * M * 16, (t + 1) * M * 16).
void small_batch_argmax_f32(float* best, int32_t* index, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const int64_t* banned, int64_t per_row);
// The lanes (bits) of the 16-column group at col that a row bans: banned [rows, per_row]
// column ids, -1 for none (nullptr: no row bans any).
inline uint32_t banned_lanes(const int64_t* banned, int64_t per_row, int64_t row, int64_t col) {
  uint32_t lanes = 0;
  for (int64_t k = 0; banned && k < per_row; ++k) {
    const uint64_t lane = static_cast<uint64_t>(banned[row * per_row + k] - col);
    if (lane < 16) lanes |= 1u << lane;
  }
  return lanes;
}
std::string small_batch_linear_f32_isa();
// Whole KV blocks between each layer's cache [2, blocks, ...] and stored blocks
// [layers, 2, block bytes], and from block to block in the caches (block_copy.cpp).
void scatter_blocks(std::vector<at::Tensor> caches, std::vector<at::Tensor> payloads, at::Tensor block_ids);
void gather_blocks(std::vector<at::Tensor> outs, std::vector<at::Tensor> caches, at::Tensor block_ids);
void copy_blocks(std::vector<at::Tensor> caches, at::Tensor src_ids, at::Tensor dst_ids);
// The DecoderLayers class (decoder.cpp), its methods listed beside it.
void register_decoder_layers(torch::Library& m);

}  // namespace kvserve
