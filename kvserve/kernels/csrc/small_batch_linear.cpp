// bf16 linear layers for decode batches and prefill chunks: y = x W^T (+ bias), streaming
// the weight once.
//
// With up to a few dozen rows of x a projection is bound by reading its weight, and
// oneDNN's kernels read cold weights at a third of the memory bandwidth (~13 of 45 GB/s
// on a Xeon with AMX). Here the weight is packed once as groups of 16 output columns with their K
// values in pairs, so each 64-byte line is one K pair of 16 columns: the operand layout
// of both `vdpbf16ps` (AVX512-BF16) and an AMX B tile (16 consecutive lines), and each
// group is one contiguous stream (the dot-product path prefetches it ahead). A tile is 4
// groups (64 columns); threads split the tiles (by halves), and all rows of x meet a tile
// while it sits in L1/L2. With AMX (16 rows per block, two blocks per pass) this beats oneDNN up
// to ~1,024 rows; with AVX512-BF16 alone, up to ~192 rows against oneDNN without AMX (and
// up to ~4 rows it beats AMX too). Larger batches (2,048-token prefill steps) stay with oneDNN.
//
// The same loops serve greedy sampling's LM head (small_batch_argmax): each row's argmax
// is kept as the tiles are computed, so the [rows, vocab] logits are never written,
// widened to fp32 and read back (at 128 rows: 14.1 -> 5.3 ms on SmolLM2's head).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "ops.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

constexpr int64_t kGroupCols = 16;  // output columns per group: one zmm of fp32 sums
constexpr int kTileGroups = 4;      // groups per tile
// Rows of x per pass over a tile: 6 x 4 accumulators + 4 weight lines + 1 broadcast, 29
// of the 32 zmm registers. Each pass re-reads the tile from L2, so past a few rows the
// loop is bound by the dot products; 6 rows rather than 4 issue a third fewer weight
// loads per product (30 layers, 16-128 rows, no AMX: 1-4% faster).
constexpr int kRowBlock = 6;
constexpr int64_t kPrefetchLines = 16;  // how far ahead in each group's stream to ask for lines
// Up to this many rows the dot-product path streams the weight faster than AMX even where
// AMX is there (30 SmolLM2 layers, 1-4 rows: 9.5-9.7 vs 10.6-11.2 ms): a 16-row tile
// would be mostly empty, and the AMX loop issues its tile loads one after another.
constexpr int64_t kDotProductMaxRows = 4;

#if defined(__AVX512BF16__)

// f(g, col, mask) for each of the `groups` groups at col0 that has columns < n: its first
// column and, as a lane mask, which of its 16 exist.
template <typename F>
inline void for_each_group(int groups, int64_t col0, int64_t n, F f) {
  for (int g = 0; g < groups; ++g) {
    const int64_t col = col0 + g * kGroupCols;
    if (col >= n) break;
    f(g, col, n - col >= kGroupCols ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (n - col)) - 1));
  }
}

// Where a tile's fp32 sums go (sum(r, g): row r of the pass, group g; rows from row0 on,
// the columns of `groups` groups from col0 on that exist). Bf16Out: plus bias, rounded to
// bf16, stored.
struct Bf16Out {
  at::BFloat16* out;
  int64_t stride, n;
  const float* bias;

  template <typename Sum>
  void operator()(int64_t row0, int64_t rows, int64_t col0, int groups, Sum sum) const {
    for_each_group(groups, col0, n, [&](int g, int64_t col, __mmask16 mask) {
      const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(sum(r, g), b));
        _mm256_mask_storeu_epi16(out + (row0 + r) * stride + col, mask, (__m256i)y);
      }
    });
  }
};

// Greedy sampling's argmax, without writing the logits: each row keeps, per lane, the
// largest value seen (rounded to bf16 as Bf16Out would store it) and its column. Strictly
// greater replaces, so among equal values the first column stays, as in torch.max.
// Columns a row bans (its stop tokens before min_tokens) never compete, as if -inf.
struct RowArgmax {
  float* best;     // [rows, 16]
  int32_t* index;  // [rows, 16]
  int64_t n;
  const int64_t* banned;  // [rows, per_row] column ids, -1 for none; nullptr: none at all
  int64_t per_row;

  // The lanes of the group at col that row may win.
  __mmask16 allowed(int64_t row, int64_t col, __mmask16 mask) const {
    return mask & static_cast<__mmask16>(~banned_lanes(banned, per_row, row, col));
  }

  template <typename Sum>
  void operator()(int64_t row0, int64_t rows, int64_t col0, int groups, Sum sum) const {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for_each_group(groups, col0, n, [&](int g, int64_t col, __mmask16 mask) {
      const __m512i cols = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(col)));
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 v = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(sum(r, g)));
        float* b = best + (row0 + r) * kGroupCols;
        int32_t* i = index + (row0 + r) * kGroupCols;
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(allowed(row0 + r, col, mask), v, _mm512_loadu_ps(b), _CMP_GT_OQ);
        _mm512_mask_storeu_ps(b, gt, v);
        _mm512_mask_storeu_epi32(i, gt, cols);
      }
    });
  }
};

// G groups (a tile, or half of one) against MR rows of x, from row0 on; sums in fp32.
template <int MR, int G, typename Sink>
void tile(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t k_pairs, const Sink& sink,
          int64_t row0, int64_t col0) {
  constexpr int64_t kLine = 2 * kGroupCols;  // bf16 per 64-byte line
  __m512 acc[MR][G];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  const int32_t* xr[MR];  // a K pair of bf16 read as one 32-bit lane, broadcast to all 16
  for (int r = 0; r < MR; ++r) xr[r] = reinterpret_cast<const int32_t*>(x + r * x_stride);
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    __m512bh b[G];
    for (int g = 0; g < G; ++g) {
      const at::BFloat16* line = w + (g * k_pairs + kp) * kLine;
      _mm_prefetch(reinterpret_cast<const char*>(line + kPrefetchLines * kLine), _MM_HINT_T0);
      b[g] = (__m512bh)_mm512_loadu_si512(line);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[r][kp]);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], a, b[g]);
    }
  }
  sink(row0, MR, col0, G, [&](int64_t r, int g) { return acc[r][g]; });
}

template <typename Sink>
using TileFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, const Sink&, int64_t, int64_t);

template <int G, typename Sink>
TileFn<Sink> pick(int mr) {
  switch (mr) {
    case 1: return &tile<1, G, Sink>;
    case 2: return &tile<2, G, Sink>;
    case 3: return &tile<3, G, Sink>;
    case 4: return &tile<4, G, Sink>;
    case 5: return &tile<5, G, Sink>;
    default: return &tile<6, G, Sink>;
  }
}

#endif

#if KVSERVE_AMX

// AMX: tiles 0-3 hold the fp32 sums of 4 groups (up to 16 rows x 16 columns each), tile 4
// a 16-row x 32-K slice of x, tiles 5/6 a group's 16 K pairs x 16 columns, which is
// exactly 16 consecutive lines of the packed layout.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxK = 32;

// One block of m <= 16 rows: tiles 0-4 hold m rows, the B tiles 5/6 16 K pairs.
void configure_tiles(int64_t m) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t <= 4 ? m : kAmxRows);
  }
  load_tile_config(cfg);
}

// Two blocks, 16 rows and m2 <= 16 rows: sums of block 0 in tiles 0/1 and of block 1 in
// 2/3 (two groups each), x slices in 4 and 5, B tiles 6/7.
void configure_pair_tiles(int64_t m2) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t == 2 || t == 3 || t == 5 ? m2 : kAmxRows);
  }
  load_tile_config(cfg);
}

// Group g's next 16 K pairs into B tile tb. No software prefetch here, unlike the
// dot-product path: each group is one sequential stream that the hardware prefetcher
// follows, and prefetches issued beside the tile loads made 8-64 rows 3-14% slower.
#define KVSERVE_AMX_LOAD_B(g, tb) \
  _tile_loadd(tb, w + ((g) * k_pairs + kc * kAmxK / 2) * 2 * kGroupCols, 64)

inline void zero_sum_tiles() {  // tiles 0-3: the fp32 sums, in both kernels
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// G groups (a tile of 64 columns, or half of one) against m <= 16 rows of x, from row0 on
// (tiles configured for m rows).
template <int G, typename Sink>
void amx_tile(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t k_pairs, const Sink& sink,
              int64_t row0, int64_t col0, int64_t m) {
  zero_sum_tiles();
  for (int64_t kc = 0; kc < 2 * k_pairs / kAmxK; ++kc) {
    _tile_loadd(4, x + kc * kAmxK, x_stride * 2);
    KVSERVE_AMX_LOAD_B(0, 5);
    _tile_dpbf16ps(0, 4, 5);
    KVSERVE_AMX_LOAD_B(1, 6);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (G == 4) {
      KVSERVE_AMX_LOAD_B(2, 5);
      _tile_dpbf16ps(2, 4, 5);
      KVSERVE_AMX_LOAD_B(3, 6);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) float sums[kTileGroups][kAmxRows][kGroupCols];
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  if constexpr (G == 4) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
  sink(row0, m, col0, G, [&](int64_t r, int g) { return _mm512_load_ps(sums[g][r]); });
}

// One tile against 16 < m <= 32 rows of x, as two blocks (tiles configured by
// configure_pair_tiles(m - 16)). Each group's B tile meets both blocks while it is
// loaded, so the second block's products overlap the weight stream rather than running
// again over the tile from L2 afterwards (17 rows cost 30% more than 16 that way). Four
// sum tiles hold two groups of both blocks: the tile's groups go in two halves.
template <int G, typename Sink>
void amx_tile_pair(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t k_pairs,
                   const Sink& sink, int64_t row0, int64_t col0, int64_t m) {
  alignas(64) float sums[2][kTileGroups][kAmxRows][kGroupCols];
  const at::BFloat16* x1 = x + kAmxRows * x_stride;
  for (int half = 0; half < G / 2; ++half) {
    zero_sum_tiles();
    for (int64_t kc = 0; kc < 2 * k_pairs / kAmxK; ++kc) {
      _tile_loadd(4, x + kc * kAmxK, x_stride * 2);
      _tile_loadd(5, x1 + kc * kAmxK, x_stride * 2);
      KVSERVE_AMX_LOAD_B(2 * half, 6);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
      KVSERVE_AMX_LOAD_B(2 * half + 1, 7);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sums[0][2 * half], 64);
    _tile_stored(1, sums[0][2 * half + 1], 64);
    _tile_stored(2, sums[1][2 * half], 64);
    _tile_stored(3, sums[1][2 * half + 1], 64);
  }
  for (int64_t block = 0; block < 2; ++block)
    sink(row0 + block * kAmxRows, block ? m - kAmxRows : kAmxRows, col0, G,
         [&](int64_t r, int g) { return _mm512_load_ps(sums[block][g][r]); });
}
#undef KVSERVE_AMX_LOAD_B

#endif

#if defined(__AVX512BF16__)

// x [M, K] and W packed as [N/16, K/2, 16, 2] (N padded to 64) fit each other, for N = n.
void check_operands(const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows of x must be contiguous");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(0) % kTileGroups == 0 &&
                  packed.size(2) == kGroupCols && packed.size(3) == 2,
              "weight must be packed as [N/16, K/2, 16, 2], N padded to a multiple of 64");
  TORCH_CHECK(x.size(1) == 2 * packed.size(1) && n <= packed.size(0) * kGroupCols, "shape mismatch");
}

// f(first group, G) over the halves [begin, end) of the tiles (2 groups each): whole
// tiles (G = 4) where both halves are in range, a lone half (G = 2) at either end.
template <typename F>
void for_each_tile(int64_t begin, int64_t end, F f) {
  int64_t h = begin;
  if (h % 2 == 1 && h < end) f(2 * h++, std::integral_constant<int, 2>{});
  for (; h + 1 < end; h += 2) f(2 * h, std::integral_constant<int, 4>{});
  if (h < end) f(2 * h, std::integral_constant<int, 2>{});
}

// Every tile of W against every row of x, the sums to the sink of the running thread:
// sink_for(thread number) is called once per thread. The threads split the tiles' halves,
// so that an odd number of tiles still splits evenly (a 576-wide projection's 9 tiles,
// 5 and 4, took as long as 10 tiles).
template <typename SinkFor>
void run_tiles(const at::Tensor& x, const at::Tensor& packed, bool use_amx, SinkFor sink_for) {
  const int64_t m = x.size(0), k_pairs = packed.size(1), halves = packed.size(0) / 2;
  const int64_t xs = x.stride(0);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  auto weights = [&](int64_t group) { return wp + group * k_pairs * 2 * kGroupCols; };
#if KVSERVE_AMX
  if (use_amx && m > kDotProductMaxRows) {
    TORCH_CHECK(x.size(1) % kAmxK == 0 && amx_permitted(), "AMX path needs K % 32 == 0 and AMX permission");
    at::parallel_for(0, halves, 1, [&](int64_t begin, int64_t end) {
      const auto sink = sink_for(at::get_thread_num());
      int64_t configured = 0;  // rows of the current configuration; a pair: 16 + its second block
      for_each_tile(begin, end, [&](int64_t group, auto groups) {
        constexpr int G = decltype(groups)::value;
        // 32 rows at a time; the tile's weights stay in L2 across the passes
        for (int64_t r0 = 0; r0 < m; r0 += 2 * kAmxRows) {
          const int64_t mr = std::min<int64_t>(2 * kAmxRows, m - r0);
          if (mr != configured) {
            mr > kAmxRows ? configure_pair_tiles(mr - kAmxRows) : configure_tiles(mr);
            configured = mr;
          }
          if (mr > kAmxRows) {
            amx_tile_pair<G>(xp + r0 * xs, xs, weights(group), k_pairs, sink, r0, group * kGroupCols, mr);
          } else {
            amx_tile<G>(xp + r0 * xs, xs, weights(group), k_pairs, sink, r0, group * kGroupCols, mr);
          }
        }
      });
      _tile_release();
    });
    return;
  }
#endif
  at::parallel_for(0, halves, 1, [&](int64_t begin, int64_t end) {
    const auto sink = sink_for(at::get_thread_num());
    using Sink = std::remove_const_t<decltype(sink)>;
    for_each_tile(begin, end, [&](int64_t group, auto groups) {
      constexpr int G = decltype(groups)::value;
      for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
        const int mr = static_cast<int>(std::min<int64_t>(kRowBlock, m - r0));
        pick<G, Sink>(mr)(xp + r0 * xs, xs, weights(group), k_pairs, sink, r0, group * kGroupCols);
      }
    });
  });
}

#endif

}  // namespace

// out [M, N] = x [M, K] @ W^T + bias: bf16 with W packed as [N/16, K/2, 16, 2] (N, K
// padded), or fp32 with W packed as [N/16, K, 16, 1] (small_batch_linear_f32.cpp).
void small_batch_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias, bool use_amx) {
  const int64_t n = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0), "out must be [M, N], rows contiguous");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, "bias: fp32 [N]");
    b = bias->data_ptr<float>();
  }
  if (x.scalar_type() == at::kFloat) return small_batch_linear_f32(out, x, packed, b);
#if defined(__AVX512BF16__)
  check_operands(x, packed, n);
  const Bf16Out sink{out.data_ptr<at::BFloat16>(), out.stride(0), n, b};
  run_tiles(x, packed, use_amx, [&](int) { return sink; });
#else
  TORCH_CHECK(false, "small_batch_linear needs AVX512-BF16; this build has none");
#endif
}

// token_ids [M] int64 = the argmax of each row of small_batch_linear's output (no bias,
// N = n; bf16 rounded as stored, fp32 as is), the first column among equal maxima,
// without writing that output: greedy sampling's LM head. banned [M, B] int64 (-1: no
// entry) names columns a row may not take. Each thread keeps its own per-lane maxima;
// they merge at the end.
void small_batch_argmax(at::Tensor& token_ids, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& banned, bool use_amx) {
  const int64_t m = x.size(0);
  TORCH_CHECK(n > 0 && token_ids.scalar_type() == at::kLong && token_ids.is_contiguous() && token_ids.numel() == m,
              "token_ids must be int64 [M], n > 0");
  const bool bans = banned.has_value() && banned->numel() > 0;
  TORCH_CHECK(!bans || (banned->scalar_type() == at::kLong && banned->is_contiguous() && banned->dim() == 2 &&
                        banned->size(0) == m),
              "banned must be contiguous int64 [M, B]");
  const int64_t* banned_ids = bans ? banned->data_ptr<int64_t>() : nullptr;
  const int64_t per_row = bans ? banned->size(1) : 0;
  const int64_t slots = at::get_num_threads() * m * kGroupCols;
  std::vector<float> best(slots, -std::numeric_limits<float>::infinity());
  std::vector<int32_t> index(slots, std::numeric_limits<int32_t>::max());
  if (x.scalar_type() == at::kFloat) {
    small_batch_argmax_f32(best.data(), index.data(), x, packed, n, banned_ids, per_row);
  } else {
#if defined(__AVX512BF16__)
    check_operands(x, packed, n);
    run_tiles(x, packed, use_amx, [&](int thread) {
      const int64_t first = thread * m * kGroupCols;
      return RowArgmax{best.data() + first, index.data() + first, n, banned_ids, per_row};
    });
#else
    TORCH_CHECK(false, "small_batch_argmax for bf16 needs AVX512-BF16; this build has none");
#endif
  }
  auto* ids = token_ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    float v = -std::numeric_limits<float>::infinity();
    int32_t i = std::numeric_limits<int32_t>::max();
    for (int64_t slot = r * kGroupCols; slot < slots; slot += m * kGroupCols)
      for (int64_t lane = slot; lane < slot + kGroupCols; ++lane)
        if (best[lane] > v || (best[lane] == v && index[lane] < i)) v = best[lane], i = index[lane];
    // every logit -inf or NaN: column 0, where torch.max would name the first NaN
    ids[r] = i == std::numeric_limits<int32_t>::max() ? 0 : i;
  }
}

// "amx" where AMX is compiled in and Linux grants it, "avx512_bf16" where only the dot
// products are, "" where this kernel cannot run (kvserve then keeps oneDNN for all sizes).
std::string small_batch_linear_isa() {
#if KVSERVE_AMX
  if (amx_permitted()) return "amx";
#endif
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#else
  return "";
#endif
}

}  // namespace kvserve
