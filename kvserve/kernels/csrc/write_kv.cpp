// The new tokens' K/V into the paged cache at their slots (slot = block * block_size + offset),
// in the form the cache stores: as computed, rounded to bf16 (fp32 compute, bf16 cache), or
// quantized to int8 rows (layers/attention/kv_quant.py: uint8 codes, then fp32 scale and
// minimum). The quantization repeats quantize_kv's fp32 operations in its order, so the codes
// equal the PyTorch path's bit for bit and a prefix attends over the same bytes whichever
// path wrote it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ops.h"
#include "vec.h"

namespace kvserve {
namespace {

// quantize_kv for one row of d values: lo = min, span = max - lo, inv = 255 / span as torch
// computes a scalar over a tensor (the reciprocal, then the product), codes rounded half to even.
template <typename T>
void quantize_row(const T* src, uint8_t* dst, int64_t d) {
  float lo = static_cast<float>(src[0]), hi = lo;
  for (int64_t i = 1; i < d; ++i) {
    const float x = static_cast<float>(src[i]);
    lo = std::min(lo, x), hi = std::max(hi, x);
  }
  const float span = hi - lo;
  const float inv = span == 0.f ? 0.f : (1.f / span) * 255.f;
  for (int64_t i = 0; i < d; ++i) {
    const float code = std::nearbyint((static_cast<float>(src[i]) - lo) * inv);
    dst[i] = static_cast<uint8_t>(std::clamp(code, 0.f, 255.f));
  }
  const float scale_min[2] = {span / 255.f, lo};
  std::memcpy(dst + d, scale_min, sizeof(scale_min));
}

// One (token, head) row of d values from T into the cache's form.
template <typename T>
void store_row(const T* src, char* dst, at::ScalarType cache, int64_t d) {
  if (cache == at::kByte) return quantize_row(src, reinterpret_cast<uint8_t*>(dst), d);
  if constexpr (std::is_same_v<T, float>) {
    if (cache == at::kBFloat16) {
      auto* out = reinterpret_cast<at::BFloat16*>(dst);
      for (int64_t i = 0; i < d; ++i) out[i] = static_cast<at::BFloat16>(src[i]);  // to nearest even
      return;
    }
  }
  std::memcpy(dst, src, d * sizeof(T));
}

}  // namespace

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "write_kv: the cache must be a contiguous [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.scalar_type() == v.scalar_type(), "write_kv: k, v [tokens, kv_heads, head_dim], dims contiguous");
  const at::ScalarType cache = kv_cache.scalar_type(), dtype = k.scalar_type();
  const int64_t heads = k.size(1), d = k.size(2);
  TORCH_CHECK(cache == dtype || (cache == at::kBFloat16 && dtype == at::kFloat) ||
                  (cache == at::kByte && (dtype == at::kFloat || dtype == at::kBFloat16)),
              "write_kv: a ", cache, " cache cannot store ", dtype, " K/V");
  TORCH_CHECK(kv_cache.size(3) == heads && kv_cache.size(4) == d + (cache == at::kByte ? kQuantTail : 0),
              "write_kv: the cache's heads and head_dim do not match k and v");
  const at::Tensor slots = as_contiguous(slot_mapping, at::kLong);
  TORCH_CHECK(slots.numel() == k.size(0), "write_kv: one slot per token");
  const int64_t slot_count = kv_cache.size(1) * kv_cache.size(2);
  const int64_t row_bytes = kv_cache.size(4) * kv_cache.element_size(), side = slot_count * heads * row_bytes;
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slot_count, "slot ", slot[t], " out of range");
  char* base = static_cast<char*>(kv_cache.data_ptr());
  auto write = [&](auto zero) {
    using T = decltype(zero);
    const T* kp = k.const_data_ptr<T>();
    const T* vp = v.const_data_ptr<T>();
    at::parallel_for(0, k.size(0), 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          char* dst = base + (slot[t] * heads + h) * row_bytes;
          store_row(kp + t * k.stride(0) + h * k.stride(1), dst, cache, d);
          store_row(vp + t * v.stride(0) + h * v.stride(1), dst + side, cache, d);
        }
    });
  };
  switch (dtype) {
    case at::kFloat: return write(float{});
    case at::kBFloat16: return write(at::BFloat16{});
    case at::kHalf: return write(at::Half{});
    default: TORCH_CHECK(false, "write_kv: unsupported dtype ", dtype);
  }
}

}  // namespace kvserve
