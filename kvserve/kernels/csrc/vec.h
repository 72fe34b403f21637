// Small vector helpers shared by kvserve's CPU kernels: fp32 lanes over any storage type.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstring>
#include <type_traits>
#include <utility>

namespace kvserve {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();

// One vector's worth of T, widened to fp32.
template <typename T>
inline fVec load_f32(const T* p) {
  fVec v;
  at::vec::load_to_float<T>(p, v);
  return v;
}
template <>
inline fVec load_f32<float>(const float* p) {
  return fVec::loadu(p);
}

// Two fp32 vectors (2W lanes) at a time: one native vector of a 16-bit T.
constexpr int64_t W2 = 2 * W;

template <typename T>
inline std::pair<fVec, fVec> load2_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return {fVec::loadu(p), fVec::loadu(p + W)};
  } else {
    auto [a, b] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
    return {a, b};
  }
}

// With AVX512-BF16 the CPU rounds fp32 to bf16 itself (to nearest even, as PyTorch's
// casts do; it flushes denormals, ~1e-38, to zero), in one instruction instead of ~10. Every CPU
// with it (Cooper Lake, Sapphire Rapids on, Zen 4 on) has AVX512-VNNI, which the int8 paths use.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define KVSERVE_NATIVE_BF16 1
inline __m512i to_bf16(const fVec& a, const fVec& b) {
  return (__m512i)_mm512_cvtne2ps_pbh(b, a);
}
#endif

// Store 2W fp32 lanes as T, rounding to nearest even as PyTorch's casts do.
template <typename T>
inline void store2_f32(T* p, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
    b.store(p + W);
#if KVSERVE_NATIVE_BF16
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    _mm512_storeu_si512(p, to_bf16(a, b));
#endif
  } else {
    at::vec::convert_from_float<T>(a, b).store(p);
  }
}

// a, b rounded to T's precision (what an op producing T would keep), still in fp32 lanes.
template <typename T>
inline std::pair<fVec, fVec> round2_to(const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<T, float>) {
    return {a, b};
#if KVSERVE_NATIVE_BF16
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m512i h = to_bf16(a, b);  // widening bf16 back to fp32 is a 16-bit shift
    return {fVec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16))),
            fVec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)))};
#endif
  } else {
    auto [x, y] = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
    return {x, y};
  }
}

// Horizontal sum / max (vec_reduce_all: Vectorized's own reduce_* don't build without SIMD).
inline float hsum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](const fVec& a, const fVec& b) { return a + b; }, v);
}
inline float hmax(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, v);
}

// K/V stored in another form than the compute dtype T (layers/attention/kv_quant.py for int8):
// bf16 under fp32 compute, or int8 rows of uint8 codes followed by the row's fp32 scale and
// minimum. The attention kernels widen such rows to T in a small buffer (once per row, for
// every query row that reads it) and run their T paths on it.
constexpr int64_t kQuantTail = 8;  // bytes after an int8 row's codes: fp32 scale, fp32 minimum

// W uint8 codes as fp32 lanes.
inline fVec load_codes(const uint8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float f[W];
  for (int64_t i = 0; i < W; ++i) f[i] = p[i];
  return fVec::loadu(f);
#endif
}

// W fp32 lanes stored as T (bf16: rounded to nearest even, as PyTorch's casts do).
template <typename T>
inline void store_f32(T* p, const fVec& a) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(p);
  } else {
    at::vec::convert_from_float<T>(a, a).store(p, W);
  }
}

// d values (a multiple of W) from f(i), W at a time, stored as T: 2W at a time where d allows
// (one native conversion to bf16 per 2W, not a partial store per W).
template <typename T, typename F>
inline void store_row(T* dst, int64_t d, F f) {
  int64_t i = 0;
  for (; i + W2 <= d; i += W2) store2_f32(dst + i, f(i), f(i + W));
  if (i < d) store_f32(dst + i, f(i));
}

// A stored row of d values (a multiple of W) as T: bf16 widened (exact: a 16-bit shift), int8
// as code * scale + minimum in fp32 (kv_quant.dequantize_kv), then rounded to T.
template <typename T>
inline void widen_row(const at::BFloat16* src, T* dst, int64_t d) {
  store_row(dst, d, [&](int64_t i) { return load_f32(src + i); });
}
template <typename T>
inline void dequantize_row(const uint8_t* src, T* dst, int64_t d) {
  float scale_min[2];
  std::memcpy(scale_min, src + d, sizeof(scale_min));
  const fVec scale(scale_min[0]), lo(scale_min[1]);
  store_row(dst, d, [&](int64_t i) { return load_codes(src + i) * scale + lo; });
}

// One row as stored (`kv`: bf16 or uint8) into T.
template <typename T>
inline void stage_row(const char* src, at::ScalarType kv, T* dst, int64_t d) {
  if (kv == at::kByte) return dequantize_row(reinterpret_cast<const uint8_t*>(src), dst, d);
  if constexpr (std::is_same_v<T, float>) widen_row(reinterpret_cast<const at::BFloat16*>(src), dst, d);
}

}  // namespace kvserve
