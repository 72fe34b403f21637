// Fused element-wise ops of a decoder layer on the CPU: RMSNorm (with the residual add
// folded in), SiLU-and-multiply, and rotary embedding in place.
//
// In eager PyTorch each of these is 5-20 small ops, each with its own dispatch,
// allocation and thread-pool wake-up; at decode batch sizes that overhead is most of
// their cost. Every intermediate is rounded to the tensor's dtype where the PyTorch
// version (kvserve/layers/layer_ops.py) rounds it: rotary gives identical bits; RMSNorm
// and SiLU can differ in the last bit now and then (fp32 sum order, exp), as tested.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "vec.h"

namespace kvserve {
namespace {

constexpr int64_t kGrainElements = 32768;  // below this much work, one thread: waking others costs more

// Round a float to T the way a PyTorch op producing T does (round to nearest even).
template <typename T>
inline float r(float x) {
  return static_cast<float>(static_cast<T>(x));
}

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

// out = weight * to_T(x * rsqrt(mean(x^2) + eps)), the statistic in fp32. Whole
// 2W-lane chunks, then a scalar tail.
template <typename T>
void rms_norm_row(T* out, const T* x, const T* w, int64_t n, float eps) {
  const int64_t nv = n - n % W2;
  fVec acc(0.f);
  for (int64_t i = 0; i < nv; i += W2) {
    auto [a, b] = load2_f32(x + i);
    acc = at::vec::fmadd(a, a, at::vec::fmadd(b, b, acc));
  }
  float ss = hsum(acc);
  for (int64_t i = nv; i < n; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float scale = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  const fVec vs(scale);
  for (int64_t i = 0; i < nv; i += W2) {
    auto [a, b] = load2_f32(x + i);
    auto [ra, rb] = round2_to<T>(a * vs, b * vs);
    auto [wa, wb] = load2_f32(w + i);
    store2_f32(out + i, wa * ra, wb * rb);
  }
  for (int64_t i = nv; i < n; ++i) {
    out[i] = static_cast<T>(static_cast<float>(w[i]) * r<T>(static_cast<float>(x[i]) * scale));
  }
}

// residual <- to_T(x + residual), in place.
template <typename T>
void add_row(T* residual, const T* x, int64_t n) {
  const int64_t nv = n - n % W2;
  for (int64_t i = 0; i < nv; i += W2) {
    auto [xa, xb] = load2_f32(x + i);
    auto [ra, rb] = load2_f32(residual + i);
    store2_f32(residual + i, xa + ra, xb + rb);
  }
  for (int64_t i = nv; i < n; ++i) residual[i] = static_cast<T>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
}

// g / (1 + exp(-g)) in fp32. exp_u20 (error ~2 fp32 ulp, invisible after bf16 rounding)
// and, with AVX-512, an approximate reciprocal refined by one Newton step (~2^-28
// relative error) instead of a division: exp and the division were this op's whole cost.
inline fVec silu(const fVec& g) {
  const fVec d = fVec(1.f) + g.neg().exp_u20();
#if defined(CPU_CAPABILITY_AVX512)  // fVec is then one __m512
  const fVec r(_mm512_rcp14_ps(d));
  return g * (r * at::vec::fnmadd(d, r, fVec(2.f)));  // r (2 - d r)
#else
  return g / d;
#endif
}

// out = to_T(silu(gate)) * up, silu in fp32.
template <typename T>
void silu_mul_row(T* out, const T* gate, const T* up, int64_t n) {
  const int64_t nv = n - n % W2;
  for (int64_t i = 0; i < nv; i += W2) {
    auto [ga, gb] = load2_f32(gate + i);
    auto [sa, sb] = round2_to<T>(silu(ga), silu(gb));
    auto [ua, ub] = load2_f32(up + i);
    store2_f32(out + i, sa * ua, sb * ub);
  }
  for (int64_t i = nv; i < n; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(r<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
}

template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor* residual) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* o = out.data_ptr<T>();
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* res = residual ? residual->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), os = out.stride(0), rs = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* src = xp + row * xs;
      if (res) {  // residual <- x + residual; normalise the sum
        add_row<T>(res + row * rs, src, n);
        src = res + row * rs;
      }
      rms_norm_row<T>(o + row * os, src, wp, n, static_cast<float>(eps));
    }
  });
}

#define KVSERVE_DISPATCH(dtype, NAME, ...)                                             \
  if ((dtype) == at::kFloat) {                                                         \
    using scalar_t = float;                                                            \
    __VA_ARGS__();                                                                     \
  } else if ((dtype) == at::kBFloat16) {                                               \
    using scalar_t = c10::BFloat16;                                                    \
    __VA_ARGS__();                                                                     \
  } else {                                                                             \
    TORCH_CHECK(false, NAME, ": dtype must be float32 or bfloat16, got ", (dtype));    \
  }

void check_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  check_rows(out, "out");
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(1), "weight must be [features]");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type(),
              "out, x and weight must agree in shape and dtype");
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(out, x, weight);
  KVSERVE_DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, weight, eps, nullptr); });
}

// residual += x (rounded); out = rms_norm(residual). vLLM's fused_add_rms_norm, out of place.
void fused_add_rms_norm(at::Tensor& out, const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_norm(out, x, weight);
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  KVSERVE_DISPATCH(x.scalar_type(), "fused_add_rms_norm",
                   [&] { rms_norm_impl<scalar_t>(out, x, weight, eps, &residual); });
}

// x = [gate | up] per row; out = to_T(silu(gate)) * up.
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_rows(out, "out");
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * n && out.size(0) == rows && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x must be [rows, 2 * n] for out [rows, n]");
  KVSERVE_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* gate = xp + row * xs;
        silu_mul_row<scalar_t>(op + row * os, gate, gate + n, n);
      }
    });
  });
}

// Rotate-half rotary embedding of q [T, Hq, D] and k [T, Hk, D] in place; cos_sin
// [T, D] holds each token's cos (first half) and sin. x1' = x1*cos - x2*sin,
// x2' = x2*cos + x1*sin, each product and each sum rounded to T as PyTorch's ops do.
void rotary_embedding(at::Tensor& q, at::Tensor& k, const at::Tensor& cos_sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "q, k: [tokens, heads, D]");
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.size(0) == tokens &&
                  cos_sin.size(1) == 2 * half && k.size(0) == tokens && k.size(2) == q.size(2),
              "rotary_embedding: cos_sin must be contiguous [tokens, D] for q, k [tokens, heads, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos_sin.scalar_type() == q.scalar_type(),
              "rotary_embedding: q, k and cos_sin must share a dtype");
  KVSERVE_DISPATCH(q.scalar_type(), "rotary_embedding", [&] {
    using T = scalar_t;
    struct Heads {  // raw pointer and strides, read once (Tensor accessors cost per call)
      T* data;
      int64_t token_stride, head_stride, heads;
    };
    const Heads hq{q.data_ptr<T>(), q.stride(0), q.stride(1), q.size(1)};
    const Heads hk{k.data_ptr<T>(), k.stride(0), k.stride(1), k.size(1)};
    auto rotate = [&](const Heads& x, int64_t t, const T* c, const T* s) {
      T* base = x.data + t * x.token_stride;
      for (int64_t h = 0; h < x.heads; ++h) {
        T* x1 = base + h * x.head_stride;
        T* x2 = x1 + half;
        const int64_t nv = half - half % W2;
        for (int64_t i = 0; i < nv; i += W2) {
          auto [a0, a1] = load2_f32(x1 + i);
          auto [b0, b1] = load2_f32(x2 + i);
          auto [c0, c1] = load2_f32(c + i);
          auto [s0, s1] = load2_f32(s + i);
          auto [ac0, ac1] = round2_to<T>(a0 * c0, a1 * c1);
          auto [bs0, bs1] = round2_to<T>(b0 * s0, b1 * s1);
          auto [bc0, bc1] = round2_to<T>(b0 * c0, b1 * c1);
          auto [as0, as1] = round2_to<T>(a0 * s0, a1 * s1);
          store2_f32(x1 + i, ac0 - bs0, ac1 - bs1);
          store2_f32(x2 + i, bc0 + as0, bc1 + as1);
        }
        for (int64_t i = nv; i < half; ++i) {
          const float a = static_cast<float>(x1[i]), b = static_cast<float>(x2[i]);
          const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
          x1[i] = static_cast<T>(r<T>(a * ci) - r<T>(b * si));
          x2[i] = static_cast<T>(r<T>(b * ci) + r<T>(a * si));
        }
      }
    };
    const T* cs = cos_sin.data_ptr<T>();
    at::parallel_for(0, tokens, grain_rows((q.size(1) + k.size(1)) * q.size(2)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate(hq, t, cs + t * 2 * half, cs + t * 2 * half + half);
        rotate(hk, t, cs + t * 2 * half, cs + t * 2 * half + half);
      }
    });
  });
}

}  // namespace kvserve
