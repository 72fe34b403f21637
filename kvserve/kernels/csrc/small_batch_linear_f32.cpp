// fp32 linear layers for decode batches and prefill chunks on AVX2 CPUs: y = x W^T (+ bias),
// streaming the weight once. small_batch_linear (small_batch_linear.cpp) hands fp32 operands here.
//
// Where there is no AVX-512 kvserve runs models in fp32. On an AVX2-only AMD EPYC,
// oneDNN's fp32 matmul took 33 ms for 30 SmolLM2 layers at 1 row and 51 ms at 8,
// against ~18 ms to read their 400 MB of weights; this kernel takes 19 and 29 ms, and
// runs at the FMA units' peak (~72 GFLOP/s) from 24 rows on, ahead of oneDNN up to ~512
// rows (1,446 vs 1,644 ms) but not at 1,024. Here the weight is packed once as
// groups of 16 output columns, K-major ([N/16, K, 16, 1]): each group is one contiguous
// stream and each 64-byte line is one k of its 16 columns, two vectors of 8. Rows of x go
// kRowBlock at a time against a group (two accumulators a row, more for blocks of 1-3
// rows: see `phases`); the next rows find the group in L1/L2. The threads split the groups.
//
// At a few rows the kernel only waits for the weight: the same loop also reads weights
// stored as bf16 (half the bytes), widened to fp32 in registers, x and the sums staying
// fp32. One k of a bf16 group is one 32-byte load; unpacking its 16-bit halves against
// zero gives fp32 exactly (bf16 is fp32's top half), and because the unpacks work within
// 128-bit lanes the columns are stored in the order they undo (`BF16_COLUMN_ORDER` in
// small_batch_linear.py).
//
// The same loops serve greedy sampling's LM head in fp32 (small_batch_argmax_f32): each row
// keeps its running argmax, so the [rows, vocab] logits are never written and read back.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>

#include "ops.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvserve {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

constexpr int64_t kGroupCols = 16;  // output columns per group: two vectors of 8
constexpr int kRowBlock = 6;        // 12 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 registers
// Bytes ahead in the group's stream to ask for, one request per 64-byte line: 1 KiB (16
// lines) took 30 fp32 layers at 6-8 rows from 25-29 to 21-24 ms, cold (the hardware
// prefetcher alone falls behind with FMAs in between). For bf16 weights (two k a line) the
// same distance in bytes, not in k, was ~2% faster at one row than half of it.
constexpr int64_t kPrefetchBytes = 1024;

// One k of a group's 16 columns as two fp32 vectors (columns 0-7, 8-15).
inline void load_k(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}

inline void load_k(const at::BFloat16* w, __m256& w0, __m256& w1) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), zero = _mm256_setzero_si256();
  w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));  // stored positions 0-3, 8-11
  w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));  // stored positions 4-7, 12-15
}

// Where a row's sums of a group go (columns col .. col + cols; lo: the group's columns 0-7,
// hi: 8-15). F32Out: plus bias, stored.
struct F32Out {
  float* out;
  int64_t stride;
  const float* bias;

  void operator()(int64_t row, int64_t col, int64_t cols, __m256 lo, __m256 hi) const {
    alignas(32) float sums[kGroupCols];
    _mm256_store_ps(sums, lo);
    _mm256_store_ps(sums + 8, hi);
    float* o = out + row * stride + col;
    for (int64_t c = 0; c < cols; ++c) o[c] = sums[c] + (bias ? bias[col + c] : 0.f);
  }
};

// Greedy sampling's argmax (small_batch_argmax), the logits never written: each row keeps,
// per lane, the largest sum seen and its column; strictly greater replaces, so the first
// column among equals stays. Banned columns and those past N never compete.
struct F32Argmax {
  float* best;     // [rows, 16]
  int32_t* index;  // [rows, 16]
  const int64_t* banned;
  int64_t per_row;

  void operator()(int64_t row, int64_t col, int64_t cols, __m256 lo, __m256 hi) const {
    const uint32_t exist = cols >= kGroupCols ? 0xFFFFu : (1u << cols) - 1;
    const uint32_t lanes = exist & ~banned_lanes(banned, per_row, row, col);
    keep(row * kGroupCols, col, lanes, lo);
    keep(row * kGroupCols + 8, col + 8, lanes >> 8, hi);
  }

  void keep(int64_t slot, int64_t col, uint32_t lanes, __m256 v) const {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i on = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(lanes)), bit);
    const __m256i allowed = _mm256_cmpeq_epi32(on, bit);
    const __m256 b = _mm256_loadu_ps(best + slot);
    const __m256 gt = _mm256_and_ps(_mm256_cmp_ps(v, b, _CMP_GT_OQ), _mm256_castsi256_ps(allowed));
    const __m256i cols =
        _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(col)));
    const __m256 i = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(index + slot)));
    _mm256_storeu_ps(best + slot, _mm256_blendv_ps(b, v, gt));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(index + slot),
                        _mm256_castps_si256(_mm256_blendv_ps(i, _mm256_castsi256_ps(cols), gt)));
  }
};

// How many interleaved partial sums each of R rows keeps over k. Each accumulator is an FMA
// chain that waits on the FMA's latency at every k it takes: one row's two chains alone ran
// at ~28 GB/s of bf16 weights from L2 (2 threads), no faster than the DRAM. With the k's
// dealt round P partial sums (added at the end) blocks of 1-3 rows keep 8-12 chains; a row
// therefore rounds differently in blocks of different sizes.
constexpr int phases(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

// x[r] . group for the R rows at x (rows row0 on), to the sink; w: the group, [K, 16], its
// columns col .. col + cols. Locality: __builtin_prefetch's, for the lines asked for ahead
// (see run_groups).
template <int R, int Locality, typename W, typename Sink>
void group_rows(const float* x, int64_t xs, const W* w, int64_t k, const Sink& sink, int64_t row0, int64_t col,
                int64_t cols) {
  constexpr int P = phases(R);
  static_assert(R >= 1 && R * P <= kRowBlock);
  // Named accumulators, not an array: with an array GCC also stored every accumulator to
  // the stack on every k (twice the instructions; 38 instead of 61 GFLOP/s at 6 rows).
  // Accumulator pair i is row i % R's partial sum over the k's j with j % P == i / R.
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  __m256 w0, w1;
#define KVSERVE_ACC(i, p)                                                  \
  if constexpr ((p) < P && R * (p) <= i && i < R * ((p) + 1)) {           \
    if constexpr (i == R * (p)) load_k(w + (j + (p)) * kGroupCols, w0, w1); \
    const __m256 xr = _mm256_broadcast_ss(x + (i - R * (p)) * xs + j + (p)); \
    a##i##0 = _mm256_fmadd_ps(xr, w0, a##i##0);                            \
    a##i##1 = _mm256_fmadd_ps(xr, w1, a##i##1);                            \
  }
#define KVSERVE_PHASE(p) \
  KVSERVE_ACC(0, p) KVSERVE_ACC(1, p) KVSERVE_ACC(2, p) KVSERVE_ACC(3, p) KVSERVE_ACC(4, p) KVSERVE_ACC(5, p)
  constexpr int64_t kStride = kGroupCols * sizeof(W);  // bytes of one k
  constexpr int64_t kPerLine = 64 / kStride;           // k's per 64-byte line: one prefetch each
  constexpr int64_t kAhead = kPrefetchBytes / kStride;
  int64_t j = 0;
  for (; j + P <= k; j += P) {
    for (int64_t p = 0; p < P; ++p)
      if ((j + p) % kPerLine == 0)
        __builtin_prefetch(w + (j + p + kAhead) * kGroupCols, 0, Locality);
    KVSERVE_PHASE(0) KVSERVE_PHASE(1) KVSERVE_PHASE(2) KVSERVE_PHASE(3)
  }
  __m256 acc[kRowBlock][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r)  // fold the phases: ((0 + 1) + (2 + 3)), or (0 + 1)
    for (int h = 0; h < 2; ++h) {
      if constexpr (P == 4) {
        acc[r][h] = _mm256_add_ps(_mm256_add_ps(acc[r][h], acc[r + R][h]),
                                  _mm256_add_ps(acc[r + 2 * R][h], acc[r + 3 * R][h]));
      } else if constexpr (P == 2) {
        acc[r][h] = _mm256_add_ps(acc[r][h], acc[r + R][h]);
      }
    }
  for (; j < k; ++j) {  // the k's past the last whole round of phases
    load_k(w + j * kGroupCols, w0, w1);
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * xs + j);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
#undef KVSERVE_PHASE
#undef KVSERVE_ACC
  for (int r = 0; r < R; ++r) sink(row0 + r, col, cols, acc[r][0], acc[r][1]);
}

template <typename W, typename Sink>
using GroupRows = void (*)(const float*, int64_t, const W*, int64_t, const Sink&, int64_t, int64_t, int64_t);

template <typename W, typename Sink, int Locality, int... Rs>
GroupRows<W, Sink> pick(int rows, std::integer_sequence<int, Rs...>) {
  GroupRows<W, Sink> f = nullptr;
  ((rows == Rs + 1 ? (f = &group_rows<Rs + 1, Locality, W, Sink>, true) : false) || ...);
  return f;
}

// Where every row meets a group in one pass (at most kRowBlock rows), its lines are asked for
// as non-temporal on AMD: the weights stream through without pushing what the step keeps in
// L2/L3 out (its activations, the K/V, the interpreter between calls): on a Zen 1 a batch-1
// step ~0.5 ms faster. More rows read each group again from L2, so there it is kept. An Intel
// core fills only L1 on prefetchnta and streams at about half the rate (a Xeon's batch-1
// fp32 step 32 against 19 ms), so there every line is asked for as t0.
bool non_temporal_streams() {
  static const bool amd = (__builtin_cpu_init(), __builtin_cpu_is("amd"));
  return amd;
}

template <typename W, typename Sink>
GroupRows<W, Sink> pick_rows(int rows, bool non_temporal) {
  constexpr auto kRows = std::make_integer_sequence<int, kRowBlock>{};
  return non_temporal ? pick<W, Sink, 0>(rows, kRows) : pick<W, Sink, 3>(rows, kRows);  // prefetchnta, prefetcht0
}

// Every group of W against every row of x, the sums to the sink of the running thread
// (sink_for(thread number), called once per thread); the threads split the groups.
template <typename W, typename SinkFor>
void run_groups(const float* xp, const W* wp, int64_t m, int64_t k, int64_t n, int64_t xs, SinkFor sink_for) {
  using Sink = decltype(sink_for(0));
  const int64_t groups = (n + kGroupCols - 1) / kGroupCols;
  // the loop for whole blocks of rows and for the last, shorter one (if any), chosen once
  const bool non_temporal = m <= kRowBlock && non_temporal_streams();
  const auto whole = pick_rows<W, Sink>(static_cast<int>(std::min<int64_t>(kRowBlock, m)), non_temporal);
  const auto last = m % kRowBlock ? pick_rows<W, Sink>(static_cast<int>(m % kRowBlock), non_temporal) : whole;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    const Sink sink = sink_for(at::get_thread_num());
    for (int64_t g = begin; g < end; ++g) {
      const int64_t col = g * kGroupCols, cols = std::min(kGroupCols, n - col);
      const W* w = wp + g * k * kGroupCols;
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock)
        (m - r0 >= kRowBlock ? whole : last)(xp + r0 * xs, xs, w, k, sink, r0, col, cols);
    }
  });
}

// The weight as stored (fp32, or bf16 widened in registers) against x, to run_groups.
template <typename SinkFor>
void run_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n, SinkFor sink_for) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat && (bf16 || packed.scalar_type() == at::kFloat),
              "fp32 x, fp32 or bf16 weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows of x must be contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kGroupCols && packed.size(3) == 1,
              "weight must be packed as [N/16, K, 16, 1]");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(packed.size(1) == k && n <= packed.size(0) * kGroupCols, "shape mismatch");
  const float* xp = x.const_data_ptr<float>();
  if (bf16) {
    run_groups(xp, packed.const_data_ptr<at::BFloat16>(), m, k, n, x.stride(0), sink_for);
  } else {
    run_groups(xp, packed.const_data_ptr<float>(), m, k, n, x.stride(0), sink_for);
  }
}

}  // namespace

void small_batch_linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const float* bias) {
  TORCH_CHECK(out.scalar_type() == at::kFloat, "fp32 out");
  const F32Out sink{out.data_ptr<float>(), out.stride(0), bias};
  run_packed(x, packed, out.size(1), [&](int) { return sink; });
}

void small_batch_argmax_f32(float* best, int32_t* index, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const int64_t* banned, int64_t per_row) {
  const int64_t per_thread = x.size(0) * kGroupCols;
  run_packed(x, packed, n, [&](int thread) {
    return F32Argmax{best + thread * per_thread, index + thread * per_thread, banned, per_row};
  });
}

#else

void small_batch_linear_f32(at::Tensor&, const at::Tensor&, const at::Tensor&, const float*) {
  TORCH_CHECK(false, "small_batch_linear for fp32 needs AVX2 and FMA; this build has neither");
}

void small_batch_argmax_f32(float*, int32_t*, const at::Tensor&, const at::Tensor&, int64_t, const int64_t*, int64_t) {
  TORCH_CHECK(false, "small_batch_argmax for fp32 needs AVX2 and FMA; this build has neither");
}

#endif

// "avx2" where the fp32 path is compiled in (AVX2 and FMA), else "".
std::string small_batch_linear_f32_isa() {
#if defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace kvserve
