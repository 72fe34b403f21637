// Flash attention for prefill chunks, reading K/V in place through block tables: for bf16
// models on AMX tiles, or with AVX512-BF16 dot products (`vdpbf16ps`) where there is no AMX
// (Zen 4) or it is withheld (KVSERVE_DISABLE_AMX=1); for fp32 models with FMAs (namespace
// f32 below: the same contract and online softmax, in simpler layouts).
//
// Same contract as paged_attention (see there): sequence s owns rows [start, start +
// qlen) of q and out, its new tokens at the end of ctx tokens of context, and query i
// sees keys [0, ctx - qlen + i]; with a sliding window (window > 0) only the last
// `window` of them, and nothing before the block of an item's lowest visible key is read
// (a window group's earlier blocks are back in the pool).
//
// Why: a chunk that follows a cached prefix otherwise goes to SDPA through a gathered
// copy of the prefix and an additive mask; the tile unit does the two matmuls of each
// step several times faster, and without it the dot products still skip the copy and the
// mask. Both bf16 paths share the layouts, the online softmax and the work split; they differ
// only in the two products (`scores`, the end of `attend_step`). Layout choices, so that
// nothing of the cache is transposed:
// - query heads that share a KV head are folded into rows, query-major (row = i * group
//   + g), so the causal limit only grows down the rows;
// - scores are computed transposed, S^T = K Q^T: the A operand is 16 keys of a page
//   exactly as the cache stores them, and the B operand is the Q tile, packed once;
// - in S^T each vector is one key for 16 rows, so the online softmax (max, exp, sums) is
//   element-wise across vectors, with no horizontal reductions;
// - P is transposed back (16x16 fp32) into the A operand of O += P V, and V pages are
//   interleaved in key pairs into the B operand, once per step for all row tiles. The
//   dot products read the same operands: a 32-bit pair of one operand broadcast against
//   a vector of the other's.
// K/V stored in another form than q (bf16 under fp32 q, int8 rows under either: vec.h's
// stage_row) are widened step by step into T rows in scratch, each row once for all the
// item's row tiles, and the products read those; on AMX an int8 cache so becomes bf16 tiles.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "paged_problem.h"
#include "vec.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

// One call's chunks and cache, for queries, K/V and output of element type T.
template <typename T>
struct ProblemOf : PagedProblem<T> {
  int64_t head_dim;
  float scale_log2;  // softmax scale times log2(e): the softmax runs in base 2
};

constexpr int64_t kMaxHeadDim = 256;  // both element types' per-tile buffers are sized for it

// Token t's row of KV head h in the cache `base` (p.k or p.v) of sequence seq.
template <typename T>
const T* key_row(const ProblemOf<T>& p, const T* base, int64_t seq, int64_t t, int64_t h) {
  const int64_t block = p.tables[seq * p.table_stride + t / p.block_size];
  return base + block * p.c_block + (t % p.block_size) * p.c_token + h * p.c_head;
}

// The same row as stored, as bytes (for the prefetches and the staging).
template <typename T>
const char* pool_row(const ProblemOf<T>& p, const char* pool, int64_t seq, int64_t t, int64_t h) {
  const int64_t block = p.tables[seq * p.table_stride + t / p.block_size];
  return pool + (block * p.c_block + (t % p.block_size) * p.c_token + h * p.c_head) * p.pool_elem;
}

template <typename T>
void prefetch_row(const ProblemOf<T>& p, const char* row) {
  for (int64_t b = 0; b < p.row_bytes; b += 64) __builtin_prefetch(row + b, 0, 2);
}

struct Item {
  int64_t seq, head, row0, rows;  // folded rows [row0, row0 + rows) of seq, for KV head `head`
};

// Items: (sequence, KV head, up to kRowTiles row tiles of kRows), longest contexts first so
// the threads end together. With fewer (sequence, KV head) pairs than two per thread,
// each pair's rows are split into that many parts: a cache hit's 32-token chunk was 3
// items (one per KV head) for 2 threads, one of which ran two while the other waited.
template <int64_t kRows, int64_t kRowTiles, typename P>
std::vector<Item> make_items(const P& p, int64_t num_seqs, int64_t kv_heads) {
  std::vector<Item> items;
  const int64_t pairs = num_seqs * kv_heads, wanted = 2 * at::get_num_threads();
  const int64_t parts = (wanted + pairs - 1) / std::max<int64_t>(pairs, 1);  // 1 where there are enough pairs
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t rows = p.query_lens[s] * p.group, tiles = (rows + kRows - 1) / kRows;
    const int64_t span = kRows * std::clamp<int64_t>((tiles + parts - 1) / parts, 1, kRowTiles);
    for (int64_t r0 = 0; r0 < rows; r0 += span)
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({s, h, r0, std::min(span, rows - r0)});
  }
  auto keys = [&](const Item& it) { return p.context_lens[it.seq] - p.query_lens[it.seq] + (it.row0 + it.rows) / p.group; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return keys(a) > keys(b); });
  return items;
}

// attend(item, scratch) for every item, each thread pulling the next in turn, between its
// begin() and end() (AMX's tile configuration). The scratch is kept per thread: building
// the bf16 path's 200 KB anew (zeroed, page-faulted in) cost ~7 us a call, half of a
// one-token chunk's whole call. On the heap, not a thread_local object: GCC specialised
// attend_step for that object's address, and then looked the address up (__tls_get_addr,
// behind a vzeroupper) on every access in its loops.
template <typename S, typename Attend>
void run_items(const std::vector<Item>& items, Attend attend, void (*begin)() = nullptr, void (*end)() = nullptr) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    static thread_local std::unique_ptr<S> scratch;
    if (!scratch) scratch = std::make_unique<S>();
    if (begin) begin();
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < static_cast<int64_t>(items.size());)
      attend(items[w], *scratch);
    if (end) end();
  });
}

#if defined(__AVX512BF16__)

constexpr int64_t kRows = 16;     // folded query rows per tile
constexpr int64_t kPage = 16;     // keys per A tile of K: one page (or a 16-key part of one)
constexpr int64_t kStep = 32;     // keys per online-softmax step: the K dim of one P V product
constexpr int64_t kRowTiles = 8;  // row tiles per work item; they share each step's packed V and K/V reads

using Problem = ProblemOf<at::BFloat16>;

#if KVSERVE_AMX
// Tiles: 0 S^T of a page, 2 K rows, 3 Q^T, 4 O, 5 P, 6 packed V; all 16 x 64 B (1 unused).
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  load_tile_config(cfg);
}
#endif

// 2^x for x <= 0 (-inf gives ~0; callers zero masked lanes): degree-5 polynomial on the
// fraction, exponent by scalef. Relative error ~2e-7, far below bf16's.
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// In-register transpose of 16 x 16 fp32 (r[i] = row i in, column i out).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}

// One row tile's state: its queries as B tiles of S^T = K Q^T, and the online softmax.
struct RowTile {
  alignas(64) at::BFloat16 qt[kMaxHeadDim / 32][16][32];  // per 32 dims: [dim pair][row][2]
  alignas(64) float o[kRows][kMaxHeadDim];                 // unnormalised output
  __m512 m, l;                                             // running max (base 2) and sum, per row
  __m512i limit;                                           // keys [0, limit) visible to each row
  int64_t max_limit, min_limit;
};

struct Scratch {
  std::vector<RowTile> tiles = std::vector<RowTile>(kRowTiles);
  alignas(64) at::BFloat16 vv[kMaxHeadDim / 16][16][32];  // a step's V: per 16 dims, [key pair][dim][2]
  alignas(64) float s[kStep][kRows];                        // S^T of a step
  alignas(64) at::BFloat16 p[kRows][kStep];                 // P of a step, the A operand
  alignas(64) at::BFloat16 zeros[64] = {};
  alignas(64) at::BFloat16 kbuf[kStep][kMaxHeadDim];  // a staged step's K and V rows
  alignas(64) at::BFloat16 vbuf[kStep][kMaxHeadDim];
  const at::BFloat16* page[2];  // the step's two K pages (16 rows, `stride` apart), null past its keys
  int64_t stride;
  const at::BFloat16* vrow[kStep];  // the step's V rows (zeros past its keys)
};

void load_row_tile(const Problem& p, const Item& it, int64_t row0, RowTile& rt) {
  const int64_t qlen = p.query_lens[it.seq], ctx = p.context_lens[it.seq], d = p.head_dim;
  alignas(64) int32_t limit[kRows];
  const at::BFloat16* src[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = row0 + r, i = std::min(row, it.row0 + it.rows - 1) / p.group;
    limit[r] = static_cast<int32_t>(ctx - qlen + i + 1);  // padding rows copy the last real one
    src[r] = row < it.row0 + it.rows
                 ? p.q + (p.query_start[it.seq] + i) * p.q_row + (it.head * p.group + row % p.group) * p.q_head
                 : nullptr;
    std::fill_n(rt.o[r], d, 0.f);
  }
  // Q^T per 32 dims: a 16 x 16 transpose of the rows' dim pairs (32 bits each)
  for (int64_t c = 0; c < d / 32; ++c) {
    __m512 v[kRows];
    for (int64_t r = 0; r < kRows; ++r)
      v[r] = src[r] ? _mm512_castsi512_ps(_mm512_loadu_si512(src[r] + c * 32)) : _mm512_setzero_ps();
    transpose16(v);
    for (int64_t j = 0; j < kRows; ++j) _mm512_store_ps(reinterpret_cast<float*>(rt.qt[c][j]), v[j]);
  }
  rt.limit = _mm512_load_si512(limit);
  rt.min_limit = limit[0], rt.max_limit = limit[kRows - 1];
  rt.m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  rt.l = _mm512_setzero_ps();
}

// V rows [t0, t0 + 32) interleaved in key pairs; keys past the context, or before the
// item's first readable key `first`, become zeros (their probabilities are 0, but 0 * a
// stale NaN would not be).
void pack_values(const Problem& p, Scratch& sc) {
  const int64_t d = p.head_dim;
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t kp = 0; kp < kStep / 2; ++kp) {
    const at::BFloat16* a = sc.vrow[2 * kp];
    const at::BFloat16* b = sc.vrow[2 * kp + 1];
    for (int64_t c = 0; c < d / 32; ++c) {
      const __m512i va = _mm512_loadu_si512(a + (a == sc.zeros ? 0 : c * 32));
      const __m512i vb = _mm512_loadu_si512(b + (b == sc.zeros ? 0 : c * 32));
      _mm512_store_si512(sc.vv[2 * c][kp], _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_store_si512(sc.vv[2 * c + 1][kp], _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// A 32-bit pair of bf16 values, broadcast to every lane: one operand of a dot product.
inline __m512bh pair_at(const at::BFloat16* x) {
  int32_t bits;
  std::memcpy(&bits, x, sizeof(bits));
  return (__m512bh)_mm512_set1_epi32(bits);
}

// S^T of one page's 16 keys (`k`: the first, rows c_token apart) for the tile's 16 rows,
// as dot products: each key's dim pairs broadcast against Q^T's vectors; 8 keys at a
// time share each load of Q^T.
void page_scores_dot(const Problem& p, const at::BFloat16* k, int64_t stride, const RowTile& rt, float (*s)[kRows]) {
  for (int64_t j0 = 0; j0 < kPage; j0 += 8) {
    __m512 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < p.head_dim / 32; ++c)
      for (int64_t jp = 0; jp < 16; ++jp) {
        const __m512bh qv = (__m512bh)_mm512_load_si512(rt.qt[c][jp]);
        for (int j = 0; j < 8; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], pair_at(k + (j0 + j) * stride + c * 32 + 2 * jp), qv);
      }
    for (int j = 0; j < 8; ++j) _mm512_store_ps(s[j0 + j], acc[j]);
  }
}

// S^T [32 keys][16 rows] for keys [t0, t0 + 32); a page past the context or before the
// first readable key (`first` is block-aligned, so a page is wholly on one side) is all -inf.
template <bool Amx>
void scores(const Problem& p, const RowTile& rt, Scratch& sc) {
  for (int64_t half = 0; half < 2; ++half) {
    const at::BFloat16* k = sc.page[half];
    if (k == nullptr) {
      for (int64_t j = 0; j < kPage; ++j) _mm512_store_ps(sc.s[half * kPage + j], _mm512_set1_ps(-INFINITY));
      continue;
    }
#if KVSERVE_AMX
    if constexpr (Amx) {
      _tile_zero(0);
      for (int64_t c = 0; c < p.head_dim / 32; ++c) {
        _tile_loadd(2, k + c * 32, sc.stride * 2);
        _tile_loadd(3, rt.qt[c], 64);
        _tile_dpbf16ps(0, 2, 3);
      }
      _tile_stored(0, sc.s[half * kPage], 64);
      continue;
    }
#endif
    page_scores_dot(p, k, sc.stride, rt, sc.s + half * kPage);
  }
}

// O += P V as dot products: each row's key pairs of P broadcast against the packed V's
// vectors; 8 rows x 32 dims of O stay in registers over the step's 32 keys.
void add_pv_dot(const Problem& p, RowTile& rt, const Scratch& sc) {
  for (int64_t c = 0; c < p.head_dim / 16; c += 2)
    for (int64_t r0 = 0; r0 < kRows; r0 += 8) {
      __m512 acc[8][2];
      for (int r = 0; r < 8; ++r)
        for (int h = 0; h < 2; ++h) acc[r][h] = _mm512_load_ps(rt.o[r0 + r] + (c + h) * 16);
      for (int64_t kp = 0; kp < kStep / 2; ++kp) {
        const __m512bh v0 = (__m512bh)_mm512_load_si512(sc.vv[c][kp]);
        const __m512bh v1 = (__m512bh)_mm512_load_si512(sc.vv[c + 1][kp]);
        for (int r = 0; r < 8; ++r) {
          const __m512bh pr = pair_at(&sc.p[r0 + r][2 * kp]);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pr, v0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pr, v1);
        }
      }
      for (int r = 0; r < 8; ++r)
        for (int h = 0; h < 2; ++h) _mm512_store_ps(rt.o[r0 + r] + (c + h) * 16, acc[r][h]);
    }
}

// Online softmax over a step's scores, then O = O * alpha + P V.
template <bool Amx>
void attend_step(const Problem& p, int64_t t0, RowTile& rt, Scratch& sc) {
  const __m512 scale = _mm512_set1_ps(p.scale_log2);
  const bool windowed = p.window > 0 && t0 < rt.max_limit - p.window;  // some row's window starts after t0
  const bool needs_mask = t0 + kStep > rt.min_limit || windowed;
  __m512 s[kStep];
  __mmask16 visible[kStep];
  __m512 m = rt.m;
  for (int64_t j = 0; j < kStep; ++j) {
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(t0 + j));
    visible[j] = needs_mask ? _mm512_cmpgt_epi32_mask(rt.limit, key) : static_cast<__mmask16>(0xFFFF);
    if (windowed)  // and limit - window <= key
      visible[j] &= _mm512_cmple_epi32_mask(rt.limit, _mm512_add_epi32(key, _mm512_set1_epi32(static_cast<int32_t>(p.window))));
    s[j] = _mm512_mask_blend_ps(visible[j], _mm512_set1_ps(-INFINITY), _mm512_mul_ps(_mm512_load_ps(sc.s[j]), scale));
    m = _mm512_max_ps(m, s[j]);
  }
  // rows' first step: exp2(-inf) ~ 0, O and l are 0; a row that sees no key yet (a window)
  // has m = -inf still, and exp2_neg maps the NaN of -inf - -inf to ~0 as well
  const __m512 alpha = exp2_neg(_mm512_sub_ps(rt.m, m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < kStep; ++j) {
    s[j] = _mm512_maskz_mov_ps(visible[j], exp2_neg(_mm512_sub_ps(s[j], m)));
    sum = _mm512_add_ps(sum, s[j]);
  }
  rt.l = _mm512_fmadd_ps(rt.l, alpha, sum);
  if (_mm512_cmpneq_ps_mask(rt.m, m)) {  // the max moved for some row: rescale its output
    alignas(64) float a[kRows];
    _mm512_store_ps(a, alpha);
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r]);
      for (int64_t c = 0; c < p.head_dim; c += 16) _mm512_store_ps(rt.o[r] + c, _mm512_mul_ps(_mm512_load_ps(rt.o[r] + c), ar));
    }
  }
  rt.m = m;
  transpose16(s);
  transpose16(s + kPage);
  for (int64_t r = 0; r < kRows; ++r) _mm512_store_si512(sc.p[r], (__m512i)_mm512_cvtne2ps_pbh(s[kPage + r], s[r]));
#if KVSERVE_AMX
  if constexpr (Amx) {
    _tile_loadd(5, sc.p, 64);
    for (int64_t c = 0; c < p.head_dim / 16; ++c) {
      _tile_loadd(4, rt.o[0] + c * 16, kMaxHeadDim * 4);
      _tile_loadd(6, sc.vv[c], 64);
      _tile_dpbf16ps(4, 5, 6);
      _tile_stored(4, rt.o[0] + c * 16, kMaxHeadDim * 4);
    }
    return;
  }
#endif
  add_pv_dot(p, rt, sc);
}

void store_rows(const Problem& p, const Item& it, int64_t row0, const RowTile& rt) {
  alignas(64) float l[kRows];
  _mm512_store_ps(l, rt.l);
  for (int64_t r = 0; r < kRows && row0 + r < it.row0 + it.rows; ++r) {
    const int64_t row = row0 + r, i = row / p.group;
    at::BFloat16* dst = p.out + (p.query_start[it.seq] + i) * p.out_row + (it.head * p.group + row % p.group) * p.out_head;
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t c = 0; c < p.head_dim; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(rt.o[r] + c), inv)));
  }
}

// Ask for the K and V rows of keys [t0, t0 + 32) while the current step is computed:
// the cached prefix sits in random pages, out of the hardware prefetcher's sight.
void prefetch_step(const Problem& p, const Item& it, int64_t t0) {
  const int64_t end = std::min<int64_t>(t0 + kStep, p.context_lens[it.seq]);
  for (int64_t t = t0; t < end; ++t) {
    prefetch_row(p, pool_row(p, p.k_pool, it.seq, t, it.head));
    prefetch_row(p, pool_row(p, p.v_pool, it.seq, t, it.head));
  }
}

// The step's K pages and V rows (keys [t0, t0 + 32)): in the pages, or staged into sc.kbuf / vbuf.
// Keys past the context, or before the item's first readable key `first` (block-aligned, so a
// page is wholly on one side), are no page and zero V rows (their probabilities are 0, but 0
// times a stale NaN would not be).
void locate_step(const Problem& p, const Item& it, int64_t t0, int64_t first, Scratch& sc) {
  const int64_t ctx = p.context_lens[it.seq];
  auto readable = [&](int64_t t) { return t < ctx && t >= first; };
  sc.stride = p.staged ? kMaxHeadDim : p.c_token;
  for (int64_t j = 0; j < kStep; ++j) {
    const int64_t t = t0 + j;
    if (!readable(t)) {
      sc.vrow[j] = sc.zeros;
    } else if (p.staged) {
      stage_row(pool_row(p, p.k_pool, it.seq, t, it.head), p.kv_dtype, sc.kbuf[j], p.head_dim);
      stage_row(pool_row(p, p.v_pool, it.seq, t, it.head), p.kv_dtype, sc.vbuf[j], p.head_dim);
      sc.vrow[j] = sc.vbuf[j];
    } else {
      sc.vrow[j] = key_row(p, p.v, it.seq, t, it.head);
    }
  }
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t t = t0 + half * kPage;
    sc.page[half] = !readable(t) ? nullptr : p.staged ? sc.kbuf[half * kPage] : key_row(p, p.k, it.seq, t, it.head);
  }
}

template <bool Amx>
void attend_item(const Problem& p, const Item& it, Scratch& sc) {
  const int64_t ntiles = (it.rows + kRows - 1) / kRows;
  for (int64_t t = 0; t < ntiles; ++t) load_row_tile(p, it, it.row0 + t * kRows, sc.tiles[t]);
  const int64_t keys = sc.tiles[ntiles - 1].max_limit;
  // with a window: the block of the item's lowest visible key (its first row's)
  const int64_t lowest = p.window > 0 ? std::max<int64_t>(0, sc.tiles[0].min_limit - p.window) : 0;
  const int64_t first = lowest / p.block_size * p.block_size;
  for (int64_t t0 = first / kStep * kStep; t0 < keys; t0 += kStep) {
    prefetch_step(p, it, t0 + kStep);
    locate_step(p, it, t0, first, sc);
    pack_values(p, sc);
    for (int64_t t = 0; t < ntiles; ++t) {
      RowTile& rt = sc.tiles[t];
      if (t0 >= rt.max_limit) continue;  // every key of this step is in this tile's future
      if (p.window > 0 && t0 + kStep <= rt.min_limit - p.window) continue;  // and in the past of its window
      scores<Amx>(p, rt, sc);
      attend_step<Amx>(p, t0, rt, sc);
    }
  }
  for (int64_t t = 0; t < ntiles; ++t) store_rows(p, it, it.row0 + t * kRows, sc.tiles[t]);
}

#endif

// fp32 models (AVX2 hosts, where dtype "auto" is fp32): the same flash attention with
// fused multiply-adds, folded query rows along the lanes, so the online softmax is again
// element-wise across vectors. S^T's products broadcast four keys' values against two
// vectors of Q^T's rows, P V's four rows' probabilities against two vectors of V rows:
// eight FMAs for six loads. On a Zen 1 it ran at ~48 GFLOP/s, two-thirds of the FMA units'
// peak, where SDPA's flash kernel reached a third.
namespace f32 {

constexpr int64_t kRows = 2 * W;  // folded query rows per tile: two vectors
constexpr int64_t kStep = 32;     // keys per online-softmax step
constexpr int64_t kRowTiles = 8;  // row tiles per work item, sharing each step's K/V rows in L1
constexpr int64_t kKeys = 4;  // keys (S^T) or rows (P V) a product broadcasts at a time

using Problem = ProblemOf<float>;

// A row tile: its queries transposed and scaled, its unnormalised output and online softmax.
// Key limits are floats, compared in lanes (exact below 2^24 keys).
struct RowTile {
  alignas(64) float qt[kMaxHeadDim][kRows];
  alignas(64) float o[kRows][kMaxHeadDim];
  alignas(64) float m[kRows], l[kRows], limit[kRows], lower[kRows];  // row sees keys [lower, limit)
  int64_t min_limit, max_limit;
};

struct Scratch {
  std::vector<RowTile> tiles = std::vector<RowTile>(kRowTiles);
  alignas(64) float s[kStep][kRows];  // S^T of a step, then P
  alignas(64) float alpha[kRows];
  const float* k[kStep];  // the step's K and V rows
  const float* v[kStep];
  alignas(64) float kbuf[kStep][kMaxHeadDim];  // a staged step's K and V rows
  alignas(64) float vbuf[kStep][kMaxHeadDim];
};

// 2^x for x <= 0: degree-5 polynomial on the fraction, the exponent put in by integer
// adds (relative error ~2e-7); below -126 it gives 2^-126 (callers zero masked lanes).
// Faster than Sleef's exp2 (Vectorized::exp2) by ~5-10% of the whole kernel on a Zen 1.
inline fVec exp2_neg(fVec x) {
  x = at::vec::maximum(x, fVec(-126.f));
  const fVec n = x.round(), f = x - n;
  fVec p(1.3333558e-3f);
  p = at::vec::fmadd(p, f, fVec(9.6181291e-3f));
  p = at::vec::fmadd(p, f, fVec(5.5504109e-2f));
  p = at::vec::fmadd(p, f, fVec(2.4022651e-1f));
  p = at::vec::fmadd(p, f, fVec(6.9314718e-1f));
  p = at::vec::fmadd(p, f, fVec(1.f));
  using iVec = at::vec::Vectorized<int32_t>;
  const iVec bits = (at::vec::convert_to_int_of_same_size(n) + iVec(127)) << iVec(23);
  return p * at::vec::cast<float>(bits);
}

void load_row_tile(const Problem& p, const Item& it, int64_t row0, RowTile& rt) {
  const int64_t qlen = p.query_lens[it.seq], ctx = p.context_lens[it.seq], end = it.row0 + it.rows;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = std::min(row0 + r, end - 1), i = row / p.group;  // padding rows copy the last real one
    const float* src = p.q + (p.query_start[it.seq] + i) * p.q_row + (it.head * p.group + row % p.group) * p.q_head;
    for (int64_t c = 0; c < p.head_dim; ++c) rt.qt[c][r] = src[c] * p.scale_log2;
    std::fill_n(rt.o[r], p.head_dim, 0.f);
    const int64_t limit = ctx - qlen + i + 1;
    rt.limit[r] = static_cast<float>(limit);
    rt.lower[r] = static_cast<float>(p.window > 0 ? std::max<int64_t>(0, limit - p.window) : 0);
    rt.m[r] = -std::numeric_limits<float>::infinity();
    rt.l[r] = 0.f;
  }
  rt.min_limit = static_cast<int64_t>(rt.limit[0]), rt.max_limit = static_cast<int64_t>(rt.limit[kRows - 1]);
}

// GCC's vectors of fVec's width for the products: arrays of them stay in registers,
// where GCC wrote arrays of Vectorized back to the stack after every FMA (the kernel ran
// at the store port's pace).
typedef float Vf __attribute__((vector_size(W * sizeof(float))));
typedef float VfU __attribute__((vector_size(W * sizeof(float)), aligned(4), may_alias));
inline Vf loadv(const float* p) { return *reinterpret_cast<const VfU*>(p); }
inline void storev(float* p, Vf v) { *reinterpret_cast<VfU*>(p) = v; }

// S^T of the step's n keys; the rest of the step -inf.
void scores(const Problem& p, int64_t n, const RowTile& rt, Scratch& sc) {
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const float* key[kKeys];
    for (int64_t j = 0; j < kKeys; ++j) key[j] = sc.k[std::min(j0 + j, n - 1)];  // never past the context
    Vf acc[kKeys][2] = {};
    for (int64_t c = 0; c < p.head_dim; ++c) {
      const Vf q0 = loadv(rt.qt[c]), q1 = loadv(rt.qt[c] + W);
      for (int64_t j = 0; j < kKeys; ++j) {
        acc[j][0] += key[j][c] * q0;  // contracted to FMAs
        acc[j][1] += key[j][c] * q1;
      }
    }
    for (int64_t j = 0; j < std::min(kKeys, n - j0); ++j) {
      storev(sc.s[j0 + j], acc[j][0]);
      storev(sc.s[j0 + j] + W, acc[j][1]);
    }
  }
  for (int64_t j = n; j < kStep; ++j) std::fill_n(sc.s[j], kRows, -std::numeric_limits<float>::infinity());
}

// The online softmax of one vector of rows (lanes [h * W, h * W + W)) over the step's
// scores, which become P; its rescale factors go to sc.alpha.
void softmax_step(int64_t t0, bool masked, int64_t h, RowTile& rt, Scratch& sc) {
  const fVec neg_inf(-std::numeric_limits<float>::infinity()), zero(0.f);
  const fVec limit = fVec::loadu(rt.limit + h * W), lower = fVec::loadu(rt.lower + h * W);
  const fVec m_old = fVec::loadu(rt.m + h * W);
  fVec s[kStep], visible[kStep], m = m_old;
  for (int64_t j = 0; j < kStep; ++j) {
    s[j] = fVec::loadu(sc.s[j] + h * W);
    if (masked) {
      const fVec key(static_cast<float>(t0 + j));
      visible[j] = (key < limit) & (key >= lower);
      s[j] = fVec::blendv(neg_inf, s[j], visible[j]);
    }
    m = at::vec::maximum(m, s[j]);
  }
  // a row that sees no key yet (a window) keeps m = -inf: subtract 0 there, not -inf (NaN)
  const fVec base = fVec::blendv(m, zero, m == neg_inf);
  const fVec alpha = fVec::blendv(zero, exp2_neg(m_old - base), m_old != neg_inf);
  fVec sum = zero;
  for (int64_t j = 0; j < kStep; ++j) {
    s[j] = exp2_neg(s[j] - base);
    if (masked) s[j] = fVec::blendv(zero, s[j], visible[j]);
    sum = sum + s[j];
    s[j].store(sc.s[j] + h * W);
  }
  at::vec::fmadd(fVec::loadu(rt.l + h * W), alpha, sum).store(rt.l + h * W);
  m.store(rt.m + h * W);
  alpha.store(sc.alpha + h * W);
}

// O = O * alpha + P V over the step's n keys.
void add_pv(const Problem& p, int64_t n, RowTile& rt, const Scratch& sc) {
  for (int64_t r = 0; r < kRows; ++r)
    if (sc.alpha[r] != 1.f) {  // the row's max moved
      const fVec a(sc.alpha[r]);
      for (int64_t c = 0; c < p.head_dim; c += W) (fVec::loadu(rt.o[r] + c) * a).store(rt.o[r] + c);
    }
  for (int64_t r0 = 0; r0 < kRows; r0 += kKeys)
    for (int64_t c = 0; c < p.head_dim; c += 2 * W) {
      Vf acc[kKeys][2];
      for (int64_t r = 0; r < kKeys; ++r)
        for (int64_t h = 0; h < 2; ++h) acc[r][h] = loadv(rt.o[r0 + r] + c + h * W);
      for (int64_t j = 0; j < n; ++j) {
        const Vf v0 = loadv(sc.v[j] + c), v1 = loadv(sc.v[j] + c + W);
        for (int64_t r = 0; r < kKeys; ++r) {
          acc[r][0] += sc.s[j][r0 + r] * v0;
          acc[r][1] += sc.s[j][r0 + r] * v1;
        }
      }
      for (int64_t r = 0; r < kKeys; ++r)
        for (int64_t h = 0; h < 2; ++h) storev(rt.o[r0 + r] + c + h * W, acc[r][h]);
    }
}

void store_rows(const Problem& p, const Item& it, int64_t row0, const RowTile& rt) {
  for (int64_t r = 0; r < kRows && row0 + r < it.row0 + it.rows; ++r) {
    const int64_t row = row0 + r, i = row / p.group;
    float* dst = p.out + (p.query_start[it.seq] + i) * p.out_row + (it.head * p.group + row % p.group) * p.out_head;
    const fVec inv(1.f / rt.l[r]);
    for (int64_t c = 0; c < p.head_dim; c += W) (fVec::loadu(rt.o[r] + c) * inv).store(dst + c);
  }
}

// The step's K and V rows; the next step's asked for while this one is computed (pages sit at random).
int64_t locate_step(const Problem& p, const Item& it, int64_t t0, Scratch& sc) {
  const int64_t ctx = p.context_lens[it.seq], n = std::min(kStep, ctx - t0);
  for (int64_t j = 0; j < n; ++j) {
    if (p.staged) {
      stage_row(pool_row(p, p.k_pool, it.seq, t0 + j, it.head), p.kv_dtype, sc.kbuf[j], p.head_dim);
      stage_row(pool_row(p, p.v_pool, it.seq, t0 + j, it.head), p.kv_dtype, sc.vbuf[j], p.head_dim);
      sc.k[j] = sc.kbuf[j], sc.v[j] = sc.vbuf[j];
    } else {
      sc.k[j] = key_row(p, p.k, it.seq, t0 + j, it.head);
      sc.v[j] = key_row(p, p.v, it.seq, t0 + j, it.head);
    }
  }
  for (int64_t t = t0 + kStep; t < std::min(t0 + 2 * kStep, ctx); ++t) {
    prefetch_row(p, pool_row(p, p.k_pool, it.seq, t, it.head));
    prefetch_row(p, pool_row(p, p.v_pool, it.seq, t, it.head));
  }
  return n;
}

void attend_item(const Problem& p, const Item& it, Scratch& sc) {
  const int64_t ntiles = (it.rows + kRows - 1) / kRows;
  for (int64_t t = 0; t < ntiles; ++t) load_row_tile(p, it, it.row0 + t * kRows, sc.tiles[t]);
  const int64_t keys = sc.tiles[ntiles - 1].max_limit;
  // with a window: from the block of the item's lowest visible key (its first row's)
  const int64_t lowest = p.window > 0 ? std::max<int64_t>(0, sc.tiles[0].min_limit - p.window) : 0;
  for (int64_t t0 = lowest / p.block_size * p.block_size; t0 < keys; t0 += kStep) {
    const int64_t n = locate_step(p, it, t0, sc);
    for (int64_t t = 0; t < ntiles; ++t) {
      RowTile& rt = sc.tiles[t];
      if (t0 >= rt.max_limit) continue;  // every key of this step is in this tile's future
      if (p.window > 0 && t0 + kStep <= rt.min_limit - p.window) continue;  // the step is past every row's window
      scores(p, n, rt, sc);
      // some row's limit falls in the step, or some row's window starts after t0
      const bool masked = t0 + kStep > rt.min_limit || (p.window > 0 && t0 < rt.max_limit - p.window);
      softmax_step(t0, masked, 0, rt, sc);
      softmax_step(t0, masked, 1, rt, sc);
      add_pv(p, n, rt, sc);
    }
  }
  for (int64_t t = 0; t < ntiles; ++t) store_rows(p, it, it.row0 + t * kRows, sc.tiles[t]);
}

void run(const Problem& p, int64_t num_seqs, int64_t kv_heads) {
  run_items<Scratch>(make_items<kRows, kRowTiles>(p, num_seqs, kv_heads),
                     [&](const Item& it, Scratch& sc) { attend_item(p, it, sc); });
}

}  // namespace f32

}  // namespace

// out[rows, heads, D] = attention of the chunks' queries over their paged K/V (see the top):
// fp32 with FMAs; bf16 on AMX tiles (`use_amx`) or with dot products.
void prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                       const at::Tensor& context_lens, double scale, int64_t window, bool use_amx) {
  const at::Tensor tables = as_contiguous(block_tables, at::kLong);
  const at::Tensor starts = as_contiguous(query_start, at::kLong);
  const at::Tensor qlens = as_contiguous(query_lens, at::kLong);
  const at::Tensor lens = as_contiguous(context_lens, at::kInt);
  check_attention_inputs(out, q, k_cache, v_cache, tables, starts, qlens, lens);
  TORCH_CHECK(q.size(2) % 32 == 0 && q.size(2) <= kMaxHeadDim && k_cache.size(1) % 16 == 0,
              "prefill_attention: head_dim must be a multiple of 32 up to 256, block_size a multiple of 16");
  auto fill = [&]<typename T>(ProblemOf<T>& p) {
    fill_paged_problem<T>(p, out, q, k_cache, v_cache, tables, starts, qlens, lens, window);
    p.head_dim = q.size(2);
    p.scale_log2 = static_cast<float>(scale / std::log(2.0));
  };
  if (q.scalar_type() == at::kFloat) {
    TORCH_CHECK(!use_amx, "prefill_attention: AMX tiles take bf16 only");
    f32::Problem p;
    fill(p);
    f32::run(p, lens.size(0), k_cache.size(2));
    return;
  }
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "prefill_attention: fp32 or bf16 only");
#if defined(__AVX512BF16__)
#if KVSERVE_AMX
  TORCH_CHECK(!use_amx || amx_permitted(), "prefill_attention: AMX is not granted to this process");
#else
  TORCH_CHECK(!use_amx, "prefill_attention: this build has no AMX");
#endif
  Problem p;
  fill(p);
  const std::vector<Item> items = make_items<kRows, kRowTiles>(p, lens.size(0), k_cache.size(2));
#if KVSERVE_AMX
  if (use_amx) {
    run_items<Scratch>(
        items, [&](const Item& it, Scratch& sc) { attend_item<true>(p, it, sc); }, configure_tiles,
        [] { _tile_release(); });
    return;
  }
#endif
  run_items<Scratch>(items, [&](const Item& it, Scratch& sc) { attend_item<false>(p, it, sc); });
#else
  TORCH_CHECK(false, "prefill_attention in bf16 needs AVX512-BF16; this build has none");
#endif
}

}  // namespace kvserve
