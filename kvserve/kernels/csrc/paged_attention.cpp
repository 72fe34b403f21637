// Paged attention on the CPU: K/V are read in place through block tables (no gather).
//
// One call serves a flat batch of sequences. Sequence s owns rows [start, start + qlen)
// of q and out: its new tokens, at the end of `ctx` tokens of context (decode: qlen = 1).
// Query i (0-based among the new tokens) attends keys [0, ctx - qlen + i]: all of the
// cached prefix and, causally, the new tokens, whose K/V the caller has already
// written. Rows of q that no sequence owns are left alone (the caller computes them
// another way). With a sliding window (window > 0, Gemma 3's local layers) query i sees
// only keys [ctx - qlen + i + 1 - window, ctx - qlen + i]: each item starts at its first
// row's lowest visible key, so blocks before it (placeholders in a window group's table,
// their blocks back in the pool) are never read.
//
// Work items are (sequence, tile of up to kQueryTile query rows); a thread runs an
// item's KV heads one after another. With fewer items than threads (a single stream),
// each item's keys are split into equal runs (to 16 keys), one per thread, and the runs'
// partial softmax states (max, sum, output) merge at the end (split-K, as vLLM's paged
// attention v2 does for long contexts). Each KV head's pass handles every query head that
// shares it (GQA), so each K/V row is read from memory once, and keeps fp32 running
// max / sum / output per row: online softmax over tiles of kTileTokens keys
// (flash-decoding style), so scratch does not grow with the context. Items are handed
// out dynamically because context lengths differ and the machine may be shared. bf16
// caches on CPUs with AVX512-BF16, and fp32 caches on AVX2, take the scores with the keys
// along the vector lanes. K/V stored in another form than q are widened tile by tile into T
// rows in scratch (vec.h's stage_row: each row once, then every query row of the item reads it
// there with the paths above), except int8 rows where a product reads them as codes, in the
// factored form q . k = scale * (q . codes) + minimum * sum(q), sum_t p_t v_t = sum_t (p_t *
// scale_t) codes_t + sum_t p_t minimum_t: int8 values always, int8 keys under bf16 queries
// (with AVX512-BF16 on integer dot products: score_tile_bf16_u8). So int8 K/V enter the products as
// their codes, never rounded to bf16 (under fp32 queries the staged rows are fp32, exact).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "paged_problem.h"
#include "vec.h"

namespace kvserve {
namespace {

constexpr int64_t kTileTokens = 64;  // keys per online-softmax step: a multiple of W
constexpr int64_t kQueryTile = 8;    // query rows of one sequence per work item
constexpr int64_t kSplitKeys = 16;   // split-K runs start at multiples of this many keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
static_assert(kTileTokens % W == 0, "score rows are processed in whole vectors");

// What every work item reads: raw pointers and strides, checked once per call.
template <typename T>
struct Problem : PagedProblem<T> {
  int64_t num_blocks, kv_heads;
  float scale;
};

struct Item {
  int64_t seq, first, last;  // query rows [first, last) of seq, as indices among its new tokens
  int64_t part = 0, parts = 1;  // which run of its keys' tiles this is, of how many
};

// bf16 caches on CPUs with AVX512-BF16 take the scores with the keys along the lanes
// (score_tile_bf16 below); everything else the generic fp32 path.
template <typename T, int D>
constexpr bool kKeyLanes =
#if KVSERVE_NATIVE_BF16
    std::is_same_v<T, at::BFloat16> && D % 32 == 0;
#else
    false;
#endif

// fp32 caches on AVX2 (8 lanes) take the scores with the keys along the lanes too
// (score_tile_f32 below).
template <typename T, int D>
constexpr bool kF32KeyLanes =
#if defined(CPU_CAPABILITY_AVX2)
    std::is_same_v<T, float> && D % 8 == 0;
#else
    false;
#endif

// A row's bytes of int8 codes in whole vectors of 64.
constexpr int64_t code_bytes(int64_t d) { return (d + 63) / 64 * 64; }

// Per-thread buffers, sized for the largest item: rows = kQueryTile * group.
struct Scratch {
  std::vector<float> q, acc, s, m, l, alpha, qsum;  // qsum: each row's sum of its queries, as in q or qb
  std::vector<uint16_t> qb;  // the queries as stored (bf16 bits), for vdpbf16ps
  std::vector<int8_t> qi;     // under int8 keys with AVX512-BF16: each row's query codes (quantize_query)
  std::vector<float> qscale;  // and their scale
  int64_t next_n = 0;         // keys located in next_keys, for the score and sum loops to prefetch
  std::vector<int64_t> limit, lower;  // keys [lower, limit) visible to each row
  std::vector<int64_t> keys, next_keys;  // cache offsets of this tile's keys and the next's
  std::vector<float> kbuf, vbuf;  // a staged tile's K and V rows as T (float or bf16 in the space of floats)
  std::vector<int64_t> staged;    // their offsets in kbuf / vbuf
  const int64_t* tile = nullptr;  // the offsets the products read this tile's rows at: keys or staged
  Scratch(int64_t rows, int64_t d)
      : q(rows * d), acc(rows * d), qb(rows * d), qi(rows * 2 * code_bytes(d)), qscale(rows),
        s(rows * kTileTokens), m(rows), l(rows), alpha(rows), qsum(rows),
        limit(rows), lower(rows), keys(kTileTokens), next_keys(kTileTokens), kbuf(kTileTokens * d),
        vbuf(kTileTokens * d), staged(kTileTokens) {}
  // Room for `rows` rows of `d` dims; what the buffers held is overwritten before it is read.
  void reserve(int64_t rows, int64_t d) {
    if (static_cast<int64_t>(q.size()) < rows * d || static_cast<int64_t>(m.size()) < rows ||
        static_cast<int64_t>(kbuf.size()) < kTileTokens * d)
      *this = Scratch(std::max<int64_t>(rows, m.size()), std::max<int64_t>(d, kbuf.size() / kTileTokens));
  }
};

// Each thread's scratch, kept between calls: allocating it was ~1 us of a layer's call. Not
// inlined: where the hot loops used the thread_local itself, its address was looked up
// again (a call, every vector register spilled) inside them.
[[gnu::noinline]] Scratch& thread_scratch(int64_t rows, int64_t d) {
  thread_local Scratch sc(0, 0);
  sc.reserve(rows, d);
  return sc;
}

// A query row's codes, to 1 part in 32,512 of its largest (bf16 keeps 1 in 256), as two int8 halves
// code = 128 * hi + lo (|hi| <= 127, |lo| <= 64) for vpdpbusd, which multiplies the keys' uint8 codes
// as stored by int8, 64 products an instruction: `hi` then `lo` in code_bytes(D) bytes each, zero
// past D. Returns their scale (0 for a row of zeros).
constexpr float kQueryCodeMax = 127.f * 128.f;

template <int D, typename T>
float quantize_query(const T* q, int8_t* hi) {
  int8_t* lo = hi + code_bytes(D);
  float mx = 0.f;
  for (int64_t d = 0; d < D; ++d) mx = std::max(mx, std::fabs(static_cast<float>(q[d])));
  const float inv = mx > 0.f ? kQueryCodeMax / mx : 0.f;
  for (int64_t d = 0; d < code_bytes(D); ++d) {
    const int32_t code = d < D ? static_cast<int32_t>(std::lrintf(static_cast<float>(q[d]) * inv)) : 0;
    const int32_t h = (code + 64) >> 7;  // arithmetic shift: the nearest multiple of 128, ties up
    hi[d] = static_cast<int8_t>(h), lo[d] = static_cast<int8_t>(code - 128 * h);
  }
  return mx / kQueryCodeMax;
}

// The item's queries (row r = query (r / group), head r % group of the group): scaled
// fp32 copies, or the stored bf16 for the key-lanes path; zeroed state, and each row's
// causal limit.
template <typename T, int D>
int64_t load_queries(const Problem<T>& p, const Item& it, int64_t h, Scratch& sc) {
  const int64_t qlen = p.query_lens[it.seq], ctx = p.context_lens[it.seq];
  int64_t r = 0;
  for (int64_t i = it.first; i < it.last; ++i) {
    const T* row = p.q + (p.query_start[it.seq] + i) * p.q_row;
    for (int64_t g = 0; g < p.group; ++g, ++r) {
      const T* src = row + (h * p.group + g) * p.q_head;
      if constexpr (kKeyLanes<T, D>) {
        std::memcpy(&sc.qb[r * D], src, D * sizeof(T));
        float sum = 0.f;  // for int8 keys' minima (unscaled, as qb)
        for (int64_t d = 0; d < D; ++d) sum += static_cast<float>(src[d]);
        sc.qsum[r] = sum;
        if (p.kv_dtype == at::kByte) sc.qscale[r] = quantize_query<D>(src, &sc.qi[r * 2 * code_bytes(D)]);
      } else {
        float sum = 0.f;
        for (int64_t d = 0; d < D; ++d) sum += (sc.q[r * D + d] = static_cast<float>(src[d]) * p.scale);
        sc.qsum[r] = sum;
      }
      std::fill_n(&sc.acc[r * D], D, 0.f);
      sc.m[r] = kNegInf;
      sc.l[r] = 0.f;
      sc.limit[r] = ctx - qlen + i + 1;
      sc.lower[r] = p.window > 0 ? std::max<int64_t>(0, sc.limit[r] - p.window) : 0;
    }
  }
  return r;
}

// Offsets (in elements, for KV head h) of keys [t0, t0 + n) of a sequence in the cache:
// the only place that knows about paging.
template <typename T>
void locate_keys(const Problem<T>& p, int64_t seq, int64_t t0, int64_t n, int64_t h, int64_t* rows) {
  const int64_t* table = p.tables + seq * p.table_stride;
  int64_t b = t0 / p.block_size, off = t0 % p.block_size;
  for (int64_t t = 0; t < n;) {
    const int64_t block = table[b];
    TORCH_CHECK(block >= 0 && block < p.num_blocks, "block id ", block, " out of range");
    const int64_t base = block * p.c_block + h * p.c_head;
    for (; off < p.block_size && t < n; ++off, ++t) rows[t] = base + off * p.c_token;
    ++b;
    off = 0;
  }
}

// Ask for the next tile's K and V rows while this one is computed. Blocks sit at random
// places in the pool, so the hardware prefetcher cannot guess where the next one is and
// every block would otherwise start with a full memory-latency miss. The requests go out
// a few at a time, the next tile's K rows beside this tile's scores and its V rows beside
// its sums (sc.next_keys, sc.next_n): a whole tile's asked for at once (256 lines with
// SmolLM2's 64-dim bf16 heads) filled the line-fill buffers and held the arithmetic until
// they drained, so loads and compute hardly overlapped (spread out, a bf16 batch-128 step
// at 500 keys took 17% less on a Xeon, an fp32 one at 32 x 800 keys 8-13% less).
// Every line of a row (int8 rows, head_dim + 8 bytes, start anywhere in a line).
template <typename T>
void prefetch_rows(const Problem<T>& p, const char* cache, const int64_t* rows, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const uintptr_t row = reinterpret_cast<uintptr_t>(cache + rows[t] * p.pool_elem);
    for (uintptr_t line = row & ~uintptr_t{63}; line < row + p.row_bytes; line += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(line), 0, 2);
  }
}

// Rows [begin, end) of the next tile from one cache, as far as it has keys (sc.next_n).
// The loops ask for a fixed count each step and for the rest after the loop: folding the
// rest into the last step's call (the same rows) made the kernel ~1.8x slower cold, for
// reasons not found; keep the count of each step's call fixed.
template <typename T>
void prefetch_next(const Problem<T>& p, const char* cache, const Scratch& sc, int64_t begin, int64_t end) {
  prefetch_rows(p, cache, sc.next_keys.data(), begin, std::min(end, sc.next_n));
}

// Rows are processed NR at a time, their queries or outputs held in registers (NR * NV
// vectors: half the register file), so each K/V row is loaded and widened to fp32 once
// for all of them rather than once per row.
template <int D>
constexpr int kRowBlock = std::clamp<int>((W >= 16 ? 16 : 8) / (D / W), 1, 4);

template <int NR, typename F>
void call_rows(int64_t nr, int64_t r0, F& f) {  // f<nr>(r0) for a runtime nr <= NR
  if constexpr (NR > 0) {
    if (nr == NR) return f(std::integral_constant<int, NR>{}, r0);
    call_rows<NR - 1>(nr, r0, f);
  }
}

template <int MaxNR, typename F>
void for_row_blocks(int64_t rows, F f) {
  for (int64_t r0 = 0; r0 < rows; r0 += MaxNR) call_rows<MaxNR>(std::min<int64_t>(MaxNR, rows - r0), r0, f);
}

#if KVSERVE_NATIVE_BF16
// bf16 with AVX512-BF16: scores with the keys along the vector lanes. vdpbf16ps multiplies
// the stored bf16 key and query pairs with fp32 sums (no widening), and a 16-way
// transposing reduction turns 16 keys' partial sums into one vector of 16 scores: ~3
// instructions per key and row instead of a horizontal sum each. The queries stay as
// stored (exact); the scale multiplies the 16 scores instead.

// One vector whose lane i is the total of acc[slot(i)], where slot(i) = 4 * (i % 4) + i / 4
// (the order the shuffles below leave the lanes in); `add` sums two vectors' lanes.
template <typename Add>
inline __m512 reduce16_by(const __m512* a, Add add) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = add(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = add(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = add(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  return add(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

inline __m512 reduce16(const __m512* a) {
  return reduce16_by(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

// The same of int32 lanes, converted to fp32 once summed.
inline __m512 reduce16_epi32(const __m512i* a) {
  __m512 f[16];
  for (int i = 0; i < 16; ++i) f[i] = _mm512_castsi512_ps(a[i]);
  const __m512 sum = reduce16_by(f, [](__m512 x, __m512 y) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
  });
  return _mm512_cvtepi32_ps(_mm512_castps_si512(sum));
}

// Keys outer, rows inner: each 16 keys' addresses are worked out once for all the rows
// (which find the keys in L1), and after them it asks for the next tile's 16 K rows
// (prefetch_next). Rows outer, every row redid the address arithmetic of every key.
template <int D>
void score_tile_bf16(const Problem<at::BFloat16>& p, int64_t n, int64_t rows, Scratch& sc) {
  constexpr int NQ = D / 32;  // vectors of 32 bf16 per row
  const __m512 scale = _mm512_set1_ps(p.scale);
  const auto* k = reinterpret_cast<const uint16_t*>(p.k);
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const uint16_t* key[16];
    for (int i = 0; i < 16; ++i) key[i] = k + sc.tile[std::min<int64_t>(t0 + i, n - 1)];  // padding: masked later
    for (int64_t r = 0; r < rows; ++r) {
      __m512bh q[NQ];
      for (int j = 0; j < NQ; ++j) q[j] = (__m512bh)_mm512_loadu_si512(&sc.qb[r * D + j * 32]);
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(key[i]), q[0]);
        for (int j = 1; j < NQ; ++j) a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(key[i] + j * 32), q[j]);
        acc[4 * (i % 4) + i / 4] = a;
      }
      _mm512_storeu_ps(&sc.s[r * kTileTokens + t0], _mm512_mul_ps(reduce16(acc), scale));
    }
    prefetch_next(p, p.k_pool, sc, t0, t0 + 16);
  }
  // the next tile's keys past this tile's last 16 (the next item's tile can be the longer)
  prefetch_next(p, p.k_pool, sc, (n + 15) / 16 * 16, kTileTokens);
}

// int8 K/V under bf16 queries, on integer dot products summed exactly into int32, then scaled in
// fp32: the keys' uint8 codes as stored against the queries' codes (quantize_query, vpdpbusd), each
// row's weights p_t * scale_t as int16 codes (weigh_tile) against the values' codes widened to int16
// (vpdpwssd). Widening the codes to fp32 or bf16 instead (two instructions per 16) left int8 slower
// than bf16 K/V where bf16 already ran at ~80% of read bandwidth. The only rounding added is the
// codes' (kQueryCodeMax, kCodeMax). The integer sums fit int32 for head dims up to 256.

// Scores: per row and key, vpdpbusd of the key's codes as stored with the query's high halves, the
// sum shifted 7 bits, then with its low halves; s = scale_t * qscale * sum + minimum_t * sum(q).
// Widening the codes to int16 for vpdpwssd (32 products an instruction) instead made the whole
// kernel 3-8% slower.
template <int D>
void score_tile_bf16_u8(const Problem<at::BFloat16>& p, int64_t n, int64_t rows, Scratch& sc) {
  static_assert(int64_t{D} * 255 * (127 * 128 + 64) <= INT32_MAX, "a key's dot product must fit int32");
  constexpr int NB = code_bytes(D) / 64;  // vectors of 64 codes per row, the last masked to D
  constexpr __mmask64 last = D % 64 ? (__mmask64{1} << (D % 64)) - 1 : ~__mmask64{0};
  const auto* k = reinterpret_cast<const uint8_t*>(p.k_pool);
  alignas(64) float kscale[16], kmin[16];
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const uint8_t* key[16];
    for (int i = 0; i < 16; ++i) {
      key[i] = k + sc.keys[std::min<int64_t>(t0 + i, n - 1)];  // padding: masked later
      float scale_min[2];
      std::memcpy(scale_min, key[i] + D, sizeof(scale_min));
      kscale[i] = scale_min[0] * p.scale, kmin[i] = scale_min[1] * p.scale;
    }
    const __m512 scale = _mm512_load_ps(kscale), minimum = _mm512_load_ps(kmin);
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* codes = &sc.qi[r * 2 * code_bytes(D)];
      __m512i hi[NB], lo[NB];
      for (int j = 0; j < NB; ++j) {
        hi[j] = _mm512_loadu_si512(codes + j * 64);
        lo[j] = _mm512_loadu_si512(codes + code_bytes(D) + j * 64);
      }
      __m512i acc[16];
      for (int i = 0; i < 16; ++i) {
        __m512i kv[NB];
        for (int j = 0; j < NB; ++j)
          kv[j] = _mm512_maskz_loadu_epi8(j + 1 < NB ? ~__mmask64{0} : last, key[i] + j * 64);
        __m512i a = _mm512_setzero_si512();
        for (int j = 0; j < NB; ++j) a = _mm512_dpbusd_epi32(a, kv[j], hi[j]);
        a = _mm512_slli_epi32(a, 7);
        for (int j = 0; j < NB; ++j) a = _mm512_dpbusd_epi32(a, kv[j], lo[j]);
        acc[4 * (i % 4) + i / 4] = a;
      }
      const __m512 rscale = _mm512_mul_ps(scale, _mm512_set1_ps(sc.qscale[r]));
      const __m512 s = _mm512_fmadd_ps(reduce16_epi32(acc), rscale, _mm512_mul_ps(minimum, _mm512_set1_ps(sc.qsum[r])));
      _mm512_storeu_ps(&sc.s[r * kTileTokens + t0], s);
    }
    prefetch_next(p, p.k_pool, sc, t0, t0 + 16);
  }
  prefetch_next(p, p.k_pool, sc, (n + 15) / 16 * 16, kTileTokens);
}

// acc[r] = alpha[r] * acc[r] + sum_t p[r, t] * v[t], in fp32. A V row of 32 bf16 widens
// with one instruction per 16 lanes (bf16 is the top half of fp32): a shift gives the
// even dims, a mask the odd ones. So acc holds each 32 dims as [even | odd]
// (unpermute_acc puts them back in order). The first block of rows asks for the next
// tile's V rows, one per V row it reads (prefetch_next).
template <int D, int NR>
void accumulate_rows_bf16(const Problem<at::BFloat16>& p, int64_t n, int64_t r0, Scratch& sc) {
  constexpr int NV = D / 16;
  const __m512i odd_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a[NR][NV];
  for (int i = 0; i < NR; ++i) {
    const __m512 alpha = _mm512_set1_ps(sc.alpha[r0 + i]);
    for (int j = 0; j < NV; ++j) a[i][j] = _mm512_mul_ps(_mm512_loadu_ps(&sc.acc[(r0 + i) * D + j * 16]), alpha);
  }
  for (int64_t t = 0; t < n; ++t) {
    if (r0 == 0) prefetch_next(p, p.v_pool, sc, t, t + 1);
    const auto* val = reinterpret_cast<const uint16_t*>(p.v + sc.tile[t]);
    __m512 v[NV];
    for (int j = 0; j < NV / 2; ++j) {
      const __m512i x = _mm512_loadu_si512(val + j * 32);
      v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, odd_mask));
    }
    for (int i = 0; i < NR; ++i) {
      const __m512 pt = _mm512_set1_ps(sc.s[(r0 + i) * kTileTokens + t]);
      for (int j = 0; j < NV; ++j) a[i][j] = _mm512_fmadd_ps(pt, v[j], a[i][j]);
    }
  }
  if (r0 == 0) prefetch_next(p, p.v_pool, sc, n, kTileTokens);
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(&sc.acc[(r0 + i) * D + j * 16], a[i][j]);
}

template <int D>
void accumulate_tile_bf16(const Problem<at::BFloat16>& p, int64_t n, int64_t rows, Scratch& sc) {
  for_row_blocks<kRowBlock<D>>(rows, [&](auto nr, int64_t r0) { accumulate_rows_bf16<D, nr()>(p, n, r0, sc); });
}

// int8 values on integer dot products (head dims a multiple of 64): two tokens' codes interleaved,
// so one vpdpwssd adds w_t * c_t[d] + w_t+1 * c_t+1[d] for 16 dims, each row's weights w_t = p_t *
// scale_t as int16 codes of one scale per tile. The unpacking leaves each 64 dims in the order
// int_value_dim gives, which acc keeps until unpermute_acc_u8.
template <int D>
constexpr bool kIntValues = D % 64 == 0;

// int16 codes that vpdpwssd reads against int8 values' codes: x ~= scale * code, |code| <= kCodeMax,
// to half a step of max |x| / kCodeMax (1 part in 65,534; bf16 itself keeps 1 in 256).
constexpr float kCodeMax = 32767.f;

// The tile's weights for row r as int16 codes, two tokens' in each int32 (tokens n.. weigh 0); returns
// their scale, and in `lo` the row's sum_t p_t * minimum_t.
inline float weigh_tile(const float* probs, const float* vscale, const float* vmin, int64_t padded, int16_t* codes, float& lo) {
  __m512 mx = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __m512 pt = _mm512_loadu_ps(probs + t);
    mx = _mm512_max_ps(mx, _mm512_mul_ps(pt, _mm512_load_ps(vscale + t)));
    sum = _mm512_fmadd_ps(pt, _mm512_load_ps(vmin + t), sum);
  }
  lo = _mm512_reduce_add_ps(sum);
  const float wmax = _mm512_reduce_max_ps(mx);
  const __m512 inv = _mm512_set1_ps(wmax > 0.f ? kCodeMax / wmax : 0.f);
  for (int64_t t = 0; t < padded; t += 16) {
    const __m512 w = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(probs + t), _mm512_load_ps(vscale + t)), inv);
    _mm256_store_si256((__m256i*)(codes + t), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(w)));
  }
  return wmax / kCodeMax;
}

template <int D, int NR>
void accumulate_rows_bf16_u8(const Problem<at::BFloat16>& p, int64_t n, int64_t r0, Scratch& sc, const float* vscale,
                             const float* vmin) {
  constexpr int NA = D / 16;  // int32 accumulators per row, 16 dims each
  const int64_t padded = (n + 15) / 16 * 16;
  alignas(64) int16_t weights[NR][kTileTokens];
  float wscale[NR], lo[NR];
  for (int i = 0; i < NR; ++i)
    wscale[i] = weigh_tile(&sc.s[(r0 + i) * kTileTokens], vscale, vmin, padded, weights[i], lo[i]);
  __m512i a[NR][NA];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NA; ++j) a[i][j] = _mm512_setzero_si512();
  const auto* pool = reinterpret_cast<const uint8_t*>(p.v_pool);
  for (int64_t t = 0; t < n; t += 2) {
    if (r0 == 0) prefetch_next(p, p.v_pool, sc, t, t + 2);
    const uint8_t* x = pool + sc.keys[t];
    const uint8_t* y = pool + sc.keys[std::min<int64_t>(t + 1, n - 1)];  // past n: weight 0
    __m512i w[NR];
    for (int i = 0; i < NR; ++i) {
      int32_t pair;
      std::memcpy(&pair, &weights[i][t], sizeof(pair));
      w[i] = _mm512_set1_epi32(pair);
    }
    for (int c = 0; c < D / 64; ++c) {
      const __m512i xs = _mm512_loadu_si512(x + c * 64), ys = _mm512_loadu_si512(y + c * 64);
      const __m512i lo8 = _mm512_unpacklo_epi8(xs, ys), hi8 = _mm512_unpackhi_epi8(xs, ys);
      const __m512i v[4] = {
          _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo8)), _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo8, 1)),
          _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi8)), _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi8, 1))};
      for (int i = 0; i < NR; ++i)
        for (int k = 0; k < 4; ++k) a[i][4 * c + k] = _mm512_dpwssd_epi32(a[i][4 * c + k], v[k], w[i]);
    }
  }
  if (r0 == 0) prefetch_next(p, p.v_pool, sc, (n + 1) / 2 * 2, kTileTokens);
  for (int i = 0; i < NR; ++i) {
    float* acc = &sc.acc[(r0 + i) * D];
    const __m512 alpha = _mm512_set1_ps(sc.alpha[r0 + i]), ws = _mm512_set1_ps(wscale[i]), low = _mm512_set1_ps(lo[i]);
    for (int j = 0; j < NA; ++j) {
      const __m512 old = _mm512_fmadd_ps(_mm512_loadu_ps(acc + j * 16), alpha, low);
      _mm512_storeu_ps(acc + j * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[i][j]), ws, old));
    }
  }
}

template <int D>
void accumulate_tile_bf16_u8(const Problem<at::BFloat16>& p, int64_t n, int64_t rows, Scratch& sc) {
  alignas(64) float vscale[kTileTokens], vmin[kTileTokens];
  const auto* pool = reinterpret_cast<const uint8_t*>(p.v_pool);
  for (int64_t t = 0; t < kTileTokens; ++t) {
    float scale_min[2] = {0.f, 0.f};
    if (t < n) std::memcpy(scale_min, pool + sc.keys[t] + D, sizeof(scale_min));
    vscale[t] = scale_min[0], vmin[t] = scale_min[1];
  }
  for_row_blocks<kRowBlock<D>>(
      rows, [&](auto nr, int64_t r0) { accumulate_rows_bf16_u8<D, nr()>(p, n, r0, sc, vscale, vmin); });
}

// The dim that position i of acc holds under accumulate_rows_bf16_u8: in each 64 dims, accumulator
// k = i / 16 (% 4) holds lanes 2 (k % 2) and 2 (k % 2) + 1 (16 dims each) of the unpacked codes,
// the first or last 8 dims of each lane for k < 2 or k >= 2 (unpacklo / unpackhi).
constexpr int int_value_dim(int i) {
  const int k = i / 16 % 4, j = i % 16, lane = 2 * (k % 2) + j / 8;
  return i / 64 * 64 + lane * 16 + k / 2 * 8 + j % 8;
}

template <int D>
void unpermute_acc_u8(Scratch& sc, int64_t rows) {
  float tmp[D];
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = &sc.acc[r * D];
    for (int i = 0; i < D; ++i) tmp[int_value_dim(i)] = acc[i];
    std::memcpy(acc, tmp, sizeof(tmp));
  }
}

// acc's [even | odd] halves of each 32 dims back in dim order, for store_output.
template <int D>
void unpermute_acc(Scratch& sc, int64_t rows) {
  float tmp[D];
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = &sc.acc[r * D];
    for (int c = 0; c < D; c += 32)
      for (int i = 0; i < 16; ++i) tmp[c + 2 * i] = acc[c + i], tmp[c + 2 * i + 1] = acc[c + 16 + i];
    std::memcpy(acc, tmp, sizeof(tmp));
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// fp32 on AVX2: 8 keys at a time, each with its own accumulator (8 independent FMA chains,
// the key rows read as memory operands), then a transposing reduction (6 vhaddps, 2 lane
// swaps) gives one vector of their 8 scores. A score per key with a horizontal sum of its
// own waited on one chain of dependent FMAs and the sum's latency: on an AMD Zen 1 that
// was ~60% of the kernel's time at batch 8.

// Lane i: the total of a[i].
inline __m256 reduce8(const __m256* a) {
  const __m256 g0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}

template <int D>
void score_tile_f32(const Problem<float>& p, int64_t n, int64_t rows, Scratch& sc) {
  for (int64_t t0 = 0; t0 < n; t0 += 8) {  // the 8 keys stay in L1 for every row
    const float* key[8];
    for (int i = 0; i < 8; ++i) key[i] = p.k + sc.tile[std::min<int64_t>(t0 + i, n - 1)];  // padding: masked later
    for (int64_t r = 0; r < rows; ++r) {
      const float* q = &sc.q[r * D];  // scaled already
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int j = 0; j < D; j += 8) {
        const __m256 qj = _mm256_loadu_ps(q + j);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(key[i] + j), acc[i]);
      }
      _mm256_storeu_ps(&sc.s[r * kTileTokens + t0], reduce8(acc));
    }
    prefetch_next(p, p.k_pool, sc, t0, t0 + 8);
  }
  prefetch_next(p, p.k_pool, sc, (n + 7) / 8 * 8, kTileTokens);
}
#endif

// s[r, t] = q[r] . k[t] for rows [r0, r0 + NR).
template <typename T, int D, int NR>
void score_rows(const Problem<T>& p, int64_t n, int64_t r0, Scratch& sc) {
  constexpr int NV = D / W;
  fVec q[NR][NV];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NV; ++j) q[i][j] = fVec::loadu(&sc.q[(r0 + i) * D + j * W]);
  for (int64_t t = 0; t < n; ++t) {
    if (r0 == 0) prefetch_next(p, p.k_pool, sc, t, t + 1);
    const T* key = p.k + sc.tile[t];
    fVec k[NV];
    for (int j = 0; j < NV; ++j) k[j] = load_f32(key + j * W);
    for (int i = 0; i < NR; ++i) {
      fVec a = q[i][0] * k[0];
      for (int j = 1; j < NV; ++j) a = at::vec::fmadd(q[i][j], k[j], a);
      sc.s[(r0 + i) * kTileTokens + t] = hsum(a);
    }
  }
  if (r0 == 0) prefetch_next(p, p.k_pool, sc, n, kTileTokens);
}

// int8 keys under bf16 queries without AVX512-BF16: s[r, t] = scale_t * (q[r] . codes_t) +
// minimum_t * sum(q[r]) for rows [r0, r0 + NR), each key's codes widened once for the rows.
template <typename T, int D, int NR>
void score_rows_u8(const Problem<T>& p, int64_t n, int64_t r0, Scratch& sc) {
  constexpr int NV = D / W;
  fVec q[NR][NV];
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NV; ++j) q[i][j] = fVec::loadu(&sc.q[(r0 + i) * D + j * W]);
  const auto* pool = reinterpret_cast<const uint8_t*>(p.k_pool);
  for (int64_t t = 0; t < n; ++t) {
    if (r0 == 0) prefetch_next(p, p.k_pool, sc, t, t + 1);
    const uint8_t* key = pool + sc.keys[t];
    float scale_min[2];
    std::memcpy(scale_min, key + D, sizeof(scale_min));
    fVec k[NV];
    for (int j = 0; j < NV; ++j) k[j] = load_codes(key + j * W);
    for (int i = 0; i < NR; ++i) {
      fVec a = q[i][0] * k[0];
      for (int j = 1; j < NV; ++j) a = at::vec::fmadd(q[i][j], k[j], a);
      sc.s[(r0 + i) * kTileTokens + t] = scale_min[0] * hsum(a) + scale_min[1] * sc.qsum[r0 + i];
    }
  }
  if (r0 == 0) prefetch_next(p, p.k_pool, sc, n, kTileTokens);
}

// Whether the scores read int8 keys as codes (no staged K rows): under bf16 queries, so that
// they are not rounded to bf16; under fp32 ones the staged rows are exact.
template <typename T>
bool scores_read_codes(const Problem<T>& p) {
  return std::is_same_v<T, at::BFloat16> && p.kv_dtype == at::kByte;
}

template <typename T, int D>
void score_tile(const Problem<T>& p, int64_t n, int64_t rows, Scratch& sc) {
  if (scores_read_codes(p)) {
#if KVSERVE_NATIVE_BF16
    if constexpr (kKeyLanes<T, D>) return score_tile_bf16_u8<D>(p, n, rows, sc);
#endif
    return for_row_blocks<kRowBlock<D>>(rows, [&](auto nr, int64_t r0) { score_rows_u8<T, D, nr()>(p, n, r0, sc); });
  }
#if KVSERVE_NATIVE_BF16
  if constexpr (kKeyLanes<T, D>) return score_tile_bf16<D>(p, n, rows, sc);
#endif
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (kF32KeyLanes<T, D>) return score_tile_f32<D>(p, n, rows, sc);
#endif
  for_row_blocks<kRowBlock<D>>(rows, [&](auto nr, int64_t r0) { score_rows<T, D, nr()>(p, n, r0, sc); });
}

// Hide keys a row may not see (causal limit) and the padding up to whole vectors.
inline void mask_tile(int64_t t0, int64_t n, int64_t rows, Scratch& sc) {
  const int64_t padded = (n + W - 1) / W * W;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = std::clamp(sc.limit[r] - t0, int64_t{0}, n);
    std::fill(&sc.s[r * kTileTokens + visible], &sc.s[r * kTileTokens + padded], kNegInf);
    const int64_t before = std::clamp(sc.lower[r] - t0, int64_t{0}, visible);  // before the window
    std::fill(&sc.s[r * kTileTokens], &sc.s[r * kTileTokens + before], kNegInf);
  }
}

// Online softmax: new running max, rescale factor for the old sum and output, and the
// tile's probabilities (unnormalised) in place of its scores. Without a window a whole
// item's rows see its first key in its first tile, so the running max is finite from then
// on; with one, or in a run of keys past a row's causal limit, a row may see nothing yet,
// and then keeps its empty state (no inf - inf).
inline void softmax_tile(int64_t n, int64_t rows, Scratch& sc) {
  const int64_t padded = (n + W - 1) / W * W;
  for (int64_t r = 0; r < rows; ++r) {
    float* s = &sc.s[r * kTileTokens];
    fVec mx(kNegInf);
    for (int64_t t = 0; t < padded; t += W) mx = at::vec::maximum(mx, fVec::loadu(s + t));
    const float m_new = std::max(sc.m[r], hmax(mx));
    if (m_new == kNegInf) {
      std::fill_n(s, padded, 0.f);
      sc.alpha[r] = 1.f;
      continue;
    }
    fVec sum(0.f), shift(m_new);
    for (int64_t t = 0; t < padded; t += W) {
      fVec e = (fVec::loadu(s + t) - shift).exp_u20();
      e.store(s + t);
      sum = sum + e;
    }
    sc.alpha[r] = std::exp(sc.m[r] - m_new);  // 0 on the first tile (m = -inf)
    sc.l[r] = sc.l[r] * sc.alpha[r] + hsum(sum);
    sc.m[r] = m_new;
  }
}

// acc[r] = alpha[r] * acc[r] + sum_t p[r, t] * v[t] for rows [r0, r0 + NR).
template <typename T, int D, int NR>
void accumulate_rows(const Problem<T>& p, int64_t n, int64_t r0, Scratch& sc) {
  constexpr int NV = D / W;
  fVec a[NR][NV];
  for (int i = 0; i < NR; ++i) {
    const fVec alpha(sc.alpha[r0 + i]);
    for (int j = 0; j < NV; ++j) a[i][j] = fVec::loadu(&sc.acc[(r0 + i) * D + j * W]) * alpha;
  }
  for (int64_t t = 0; t < n; ++t) {
    if (r0 == 0) prefetch_next(p, p.v_pool, sc, t, t + 1);
    const T* val = p.v + sc.tile[t];
    fVec v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load_f32(val + j * W);
    for (int i = 0; i < NR; ++i) {
      const fVec pt(sc.s[(r0 + i) * kTileTokens + t]);
      for (int j = 0; j < NV; ++j) a[i][j] = at::vec::fmadd(pt, v[j], a[i][j]);
    }
  }
  if (r0 == 0) prefetch_next(p, p.v_pool, sc, n, kTileTokens);
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NV; ++j) a[i][j].store(&sc.acc[(r0 + i) * D + j * W]);
}

// int8 values: acc[r] = alpha[r] * acc[r] + sum_t (p[r, t] * scale_t) * codes_t + sum_t p[r, t] *
// minimum_t, each row's codes widened once for all NR rows; the minima's sum joins acc at the end.
template <typename T, int D, int NR>
void accumulate_rows_u8(const Problem<T>& p, int64_t n, int64_t r0, Scratch& sc) {
  constexpr int NV = D / W;
  fVec a[NR][NV];
  float lo[NR] = {};
  for (int i = 0; i < NR; ++i) {
    const fVec alpha(sc.alpha[r0 + i]);
    for (int j = 0; j < NV; ++j) a[i][j] = fVec::loadu(&sc.acc[(r0 + i) * D + j * W]) * alpha;
  }
  const auto* pool = reinterpret_cast<const uint8_t*>(p.v_pool);
  for (int64_t t = 0; t < n; ++t) {
    if (r0 == 0) prefetch_next(p, p.v_pool, sc, t, t + 1);
    const uint8_t* val = pool + sc.keys[t];
    float scale_min[2];
    std::memcpy(scale_min, val + D, sizeof(scale_min));
    fVec v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load_codes(val + j * W);
    for (int i = 0; i < NR; ++i) {
      const float pt = sc.s[(r0 + i) * kTileTokens + t];
      lo[i] += pt * scale_min[1];
      const fVec ps(pt * scale_min[0]);
      for (int j = 0; j < NV; ++j) a[i][j] = at::vec::fmadd(ps, v[j], a[i][j]);
    }
  }
  if (r0 == 0) prefetch_next(p, p.v_pool, sc, n, kTileTokens);
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NV; ++j) (a[i][j] + fVec(lo[i])).store(&sc.acc[(r0 + i) * D + j * W]);
}

template <typename T, int D>
void accumulate_tile(const Problem<T>& p, int64_t n, int64_t rows, Scratch& sc) {
#if KVSERVE_NATIVE_BF16
  if constexpr (kKeyLanes<T, D> && kIntValues<D>)
    if (p.kv_dtype == at::kByte) return accumulate_tile_bf16_u8<D>(p, n, rows, sc);
#endif
  if (p.kv_dtype == at::kByte) {
    return for_row_blocks<kRowBlock<D>>(rows, [&](auto nr, int64_t r0) { accumulate_rows_u8<T, D, nr()>(p, n, r0, sc); });
  }
#if KVSERVE_NATIVE_BF16
  if constexpr (kKeyLanes<T, D>) return accumulate_tile_bf16<D>(p, n, rows, sc);
#endif
  for_row_blocks<kRowBlock<D>>(rows, [&](auto nr, int64_t r0) { accumulate_rows<T, D, nr()>(p, n, r0, sc); });
}

template <typename T, int D>
void store_output(const Problem<T>& p, const Item& it, int64_t h, const Scratch& sc) {
  int64_t r = 0;
  for (int64_t i = it.first; i < it.last; ++i) {
    T* row = p.out + (p.query_start[it.seq] + i) * p.out_row;
    for (int64_t g = 0; g < p.group; ++g, ++r) {
      T* dst = row + (h * p.group + g) * p.out_head;
      const float inv = 1.f / sc.l[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(sc.acc[r * D + d] * inv);
    }
  }
}

// Keys [0, n) of an item: up to the last row's causal limit.
template <typename T>
int64_t item_keys(const Problem<T>& p, const Item& it) {
  return p.context_lens[it.seq] - p.query_lens[it.seq] + it.last;
}

// The item's first key: 0, or with a window its first row's lowest visible one.
template <typename T>
int64_t item_first_key(const Problem<T>& p, const Item& it) {
  if (p.window <= 0) return 0;
  return std::max<int64_t>(0, p.context_lens[it.seq] - p.query_lens[it.seq] + it.first + 1 - p.window);
}

// Tiles of kTileTokens keys the whole item reads, from its first key on.
template <typename T>
int64_t item_tiles(const Problem<T>& p, const Item& it) {
  return (item_keys(p, it) - item_first_key(p, it) + kTileTokens - 1) / kTileTokens;
}

// The keys [begin, end) this item reads: its share of them, cut at multiples of kSplitKeys,
// so the runs differ by at most that many keys. Runs of whole tiles did not: a context of
// 5 tiles left one thread 3 of them and the other waiting for it.
template <typename T>
std::pair<int64_t, int64_t> key_range(const Problem<T>& p, const Item& it) {
  const int64_t first = item_first_key(p, it), end = item_keys(p, it);
  auto edge = [&](int64_t part) {
    return part == it.parts ? end : first + (end - first) * part / it.parts / kSplitKeys * kSplitKeys;
  };
  return {edge(it.part), edge(it.part + 1)};
}

// Locate keys [t0, min(t0 + kTileTokens, end)) of (item, head) into rows; how many there are.
template <typename T>
int64_t locate_tile(const Problem<T>& p, const Item& it, int64_t h, int64_t t0, int64_t end, int64_t* rows) {
  const int64_t n = std::min(kTileTokens, end - t0);
  locate_keys(p, it.seq, t0, n, h, rows);
  return n;
}

// The same for the item's first tile.
template <typename T>
int64_t locate_first_tile(const Problem<T>& p, const Item& it, int64_t h, int64_t* rows) {
  const auto [begin, end] = key_range(p, it);
  return locate_tile(p, it, h, begin, end, rows);
}

// Locate the item's first tile and start loading its K and V rows, all at once: nothing
// is being computed yet that the requests could go out beside.
template <typename T, int D>
void fetch_first_tile(const Problem<T>& p, const Item& it, int64_t h, int64_t* rows) {
  const int64_t n = locate_first_tile(p, it, h, rows);
  prefetch_rows(p, p.k_pool, rows, 0, n);
  prefetch_rows(p, p.v_pool, rows, 0, n);
}

// Attention for one (item, KV head). Its first tile was fetched into sc.keys by the
// caller; while a tile is computed the next one is fetched (located here, asked for by
// the score and sum loops), and after the last tile, the first tile of `then` (the
// thread's next work item), so loads never wait idle. An item that is one run of several
// leaves its state in `partial` for merge_parts.
// The tile's n K and V rows, stored in another form than T, widened into the scratch's T rows
// where the products do not read them as stored: K unless the scores read int8 codes, V unless
// it is int8 (so only bf16 rows, and int8 keys under fp32 queries, which stay exact).
template <typename T, int D>
void stage_tile(const Problem<T>& p, int64_t n, Scratch& sc) {
  const bool keys = !scores_read_codes(p), values = p.kv_dtype != at::kByte;
  if (!keys && !values) return;
  T* k = reinterpret_cast<T*>(sc.kbuf.data());
  T* v = reinterpret_cast<T*>(sc.vbuf.data());
  for (int64_t t = 0; t < n; ++t) {
    if (keys) stage_row(p.k_pool + sc.keys[t] * p.pool_elem, p.kv_dtype, k + t * D, D);
    if (values) stage_row(p.v_pool + sc.keys[t] * p.pool_elem, p.kv_dtype, v + t * D, D);
    sc.staged[t] = t * D;
  }
  sc.tile = sc.staged.data();
}

// What the products of a staged problem read: the thread's widened tile.
template <typename T>
Problem<T> staged_view(const Problem<T>& p, Scratch& sc) {
  Problem<T> view = p;
  view.k = reinterpret_cast<const T*>(sc.kbuf.data());
  view.v = reinterpret_cast<const T*>(sc.vbuf.data());
  return view;
}

template <typename T, int D>
void attend_item(const Problem<T>& p, const Item& it, int64_t h, const Item* then, int64_t then_h, Scratch& sc,
                 float* partial) {
  const int64_t rows = load_queries<T, D>(p, it, h, sc);
  const auto [begin, keys] = key_range(p, it);
  const Problem<T> c = p.staged ? staged_view(p, sc) : p;
  for (int64_t t0 = begin; t0 < keys; t0 += kTileTokens) {
    const int64_t n = std::min(kTileTokens, keys - t0);
    sc.next_n = 0;
    if (t0 + n < keys) {
      sc.next_n = locate_tile(p, it, h, t0 + n, keys, sc.next_keys.data());
    } else if (then != nullptr) {
      sc.next_n = locate_first_tile(p, *then, then_h, sc.next_keys.data());
    }
    sc.tile = sc.keys.data();
    if (p.staged) stage_tile<T, D>(p, n, sc);
    score_tile<T, D>(c, n, rows, sc);
    mask_tile(t0, n, rows, sc);
    softmax_tile(n, rows, sc);
    accumulate_tile<T, D>(c, n, rows, sc);
    std::swap(sc.keys, sc.next_keys);
  }
#if KVSERVE_NATIVE_BF16
  if constexpr (kKeyLanes<T, D>) {
    if (p.kv_dtype != at::kByte) unpermute_acc<D>(sc, rows);
    if constexpr (kIntValues<D>)
      if (p.kv_dtype == at::kByte) unpermute_acc_u8<D>(sc, rows);
  }
#endif
  if (it.parts == 1) return store_output<T, D>(p, it, h, sc);
  float* state = partial + h * rows * (D + 2);  // per row: max, sum, output
  for (int64_t r = 0; r < rows; ++r, state += D + 2) {
    state[0] = sc.m[r], state[1] = sc.l[r];
    std::memcpy(state + 2, &sc.acc[r * D], D * sizeof(float));
  }
}

// The runs of each split item (consecutive in `units`) into its output rows: each run's
// sum and output scaled by exp(its max - the largest), as the online softmax rescales.
// Every row sees at least its own key, so the largest max is finite.
template <typename T, int D>
void merge_parts(const Problem<T>& p, const std::vector<Item>& units, const std::vector<float>& partial,
                 int64_t unit_floats) {
  for (size_t u0 = 0; u0 < units.size(); u0 += units[u0].parts) {
    const Item& it = units[u0];
    if (it.parts == 1) continue;
    const int64_t rows = (it.last - it.first) * p.group;
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        auto state = [&](int64_t part) { return &partial[(u0 + part) * unit_floats + (h * rows + r) * (D + 2)]; };
        float m = kNegInf, l = 0.f, acc[D] = {};
        for (int64_t part = 0; part < it.parts; ++part) m = std::max(m, state(part)[0]);
        for (int64_t part = 0; part < it.parts; ++part) {
          const float* s = state(part);
          const float scale = std::exp(s[0] - m);  // 0 for a run this row sees nothing of
          l += s[1] * scale;
          for (int64_t d = 0; d < D; ++d) acc[d] += s[2 + d] * scale;
        }
        const int64_t i = it.first + r / p.group, g = r % p.group;
        T* dst = p.out + (p.query_start[it.seq] + i) * p.out_row + (h * p.group + g) * p.out_head;
        const float inv = 1.f / l;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
      }
    }
  }
}

// Split each sequence's query rows into tiles; decode rows are one item each. Longest
// first (keys to read), so that the threads, pulling items in turn, end together: in
// batch order a long context claimed last kept one thread busy while the other waited.
template <typename T>
std::vector<Item> make_items(const Problem<T>& p, int64_t num_seqs) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = p.query_lens[s];
    for (int64_t i = 0; i < qlen; i += kQueryTile) items.push_back({s, i, std::min(qlen, i + kQueryTile)});
  }
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return item_keys(p, a) > item_keys(p, b); });
  return items;
}

// Fewer items than threads: each item's tiles in runs, one per thread it may have (at most
// one run per tile), consecutive in the result. Items of a single tile stay whole.
template <typename T>
std::vector<Item> split_keys(const Problem<T>& p, const std::vector<Item>& items, int64_t threads) {
  std::vector<Item> units;
  const int64_t per_item = threads / static_cast<int64_t>(items.size());
  for (const Item& it : items) {
    const int64_t parts = std::max<int64_t>(1, std::min(per_item, item_tiles(p, it)));
    for (int64_t part = 0; part < parts; ++part) units.push_back({it.seq, it.first, it.last, part, parts});
  }
  return units;
}

template <typename T, int D>
void run(const Problem<T>& p, const std::vector<Item>& whole) {
  static_assert(D % W == 0, "head_dim is processed in whole vectors");
  const int64_t threads = at::get_num_threads();
  const std::vector<Item> items =
      static_cast<int64_t>(whole.size()) < threads ? split_keys(p, whole, threads) : whole;
  const int64_t n_items = static_cast<int64_t>(items.size());
  // scratch and partial states sized for the largest item's rows (a decode's 1 x group, not a
  // whole query tile's): zeroing the tile's size each call was most of a short context's time
  int64_t max_rows = 0;
  for (const Item& it : items) max_rows = std::max(max_rows, (it.last - it.first) * p.group);
  const int64_t unit_floats = p.kv_heads * max_rows * (D + 2);
  const bool split = n_items > static_cast<int64_t>(whole.size());
  std::vector<float> partial(split ? n_items * unit_floats : 0);
  std::atomic<int64_t> next{0};
  // One task per thread, each pulling whole items and running their KV heads one after
  // another. A block holds every head's slice of a token side by side, and lines the L2
  // streamer fetches beyond one head's slices are the next head's: with the heads of an
  // item spread over both threads' L2s, cold steps ran 5-10% slower.
  // Fewer items than threads and none split (contexts of one tile): their KV heads go to the
  // threads one by one instead, or one thread would run the whole call while the other waited.
  const bool by_head = !split && n_items < threads;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch& sc = thread_scratch(max_rows, D);
    auto claim = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
    if (by_head) {
      for (int64_t u; (u = claim()) < n_items * p.kv_heads;) {
        const Item& it = items[u / p.kv_heads];
        const int64_t h = u % p.kv_heads;
        fetch_first_tile<T, D>(p, it, h, sc.keys.data());
        attend_item<T, D>(p, it, h, nullptr, 0, sc, nullptr);
      }
      return;
    }
    int64_t i = claim();
    if (i < n_items) fetch_first_tile<T, D>(p, items[i], 0, sc.keys.data());
    while (i < n_items) {
      // each head's pass prefetches the first keys of the next head, the last one those of
      // the next item, claimed one ahead for that
      float* state = split ? &partial[i * unit_floats] : nullptr;
      for (int64_t h = 0; h + 1 < p.kv_heads; ++h) attend_item<T, D>(p, items[i], h, &items[i], h + 1, sc, state);
      const int64_t ni = claim();
      attend_item<T, D>(p, items[i], p.kv_heads - 1, ni < n_items ? &items[ni] : nullptr, 0, sc, state);
      i = ni;
    }
  });
  if (split) merge_parts<T, D>(p, items, partial, unit_floats);
}

template <typename T>
Problem<T> make_problem(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& query_start,
                        const at::Tensor& query_lens, const at::Tensor& context_lens, double scale,
                        int64_t window) {
  Problem<T> p;
  fill_paged_problem<T>(p, out, q, k_cache, v_cache, tables, query_start, query_lens, context_lens, window);
  p.num_blocks = k_cache.size(0), p.kv_heads = k_cache.size(2);
  p.scale = static_cast<float>(scale);
  return p;
}

}  // namespace

void check_attention_inputs(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& query_start,
                            const at::Tensor& query_lens, const at::Tensor& context_lens) {
  for (const at::Tensor* t : {&out, &q, &k_cache, &v_cache, &tables, &query_start, &query_lens, &context_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: all tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [rows, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "k_cache and v_cache must be [blocks, block_size, kv_heads, head_dim] with equal strides");
  const at::ScalarType dtype = q.scalar_type(), kv = k_cache.scalar_type();
  TORCH_CHECK(dtype == out.scalar_type() && kv == v_cache.scalar_type(), "q and out, and the caches, must share a dtype");
  TORCH_CHECK(kv == dtype || (kv == at::kBFloat16 && dtype == at::kFloat) ||
                  (kv == at::kByte && (dtype == at::kFloat || dtype == at::kBFloat16)),
              "the caches must be of q's dtype, bf16 under fp32 q, or int8 rows (uint8) under fp32 or bf16 q; got ",
              kv, " under ", dtype);
  TORCH_CHECK(q.size(2) + (kv == at::kByte ? kQuantTail : 0) == k_cache.size(3) && k_cache.size(2) > 0 &&
                  q.size(1) % k_cache.size(2) == 0,
              "head_dim must match (int8 rows: head_dim + 8 bytes) and query heads must be a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1, "head_dim must be contiguous");
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && query_start.numel() == num_seqs &&
                  query_lens.numel() == num_seqs,
              "block_tables [seqs, max_blocks], query_start, query_lens and context_lens [seqs]");
  const auto* qs = query_start.const_data_ptr<int64_t>();
  const auto* ql = query_lens.const_data_ptr<int64_t>();
  const auto* ctx = context_lens.const_data_ptr<int32_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = ql[s];
    TORCH_CHECK(qs[s] >= 0 && qlen >= 0 && qs[s] + qlen <= q.size(0), "sequence ", s, ": rows out of range");
    TORCH_CHECK(ctx[s] >= qlen && (ctx[s] > 0 || qlen == 0), "sequence ", s, ": context shorter than its queries");
    TORCH_CHECK(ctx[s] <= tables.size(1) * k_cache.size(1), "sequence ", s, ": context exceeds its block table");
  }
}

namespace {

// The head dims compiled in (each is a template instance); other models use the PyTorch path.
using HeadDims = std::integer_sequence<int, 16, 32, 64, 80, 96, 128, 256>;

template <typename T, int... Ds>
void dispatch_head_dim(const Problem<T>& p, int64_t head_dim, const std::vector<Item>& items,
                       std::integer_sequence<int, Ds...>) {
  const bool found = ((head_dim == Ds && (run<T, Ds>(p, items), true)) || ...);
  TORCH_CHECK(found, "paged_attention: unsupported head_dim ", head_dim);
}

template <int... Ds>
std::vector<int64_t> head_dims(std::integer_sequence<int, Ds...>) {
  return {Ds...};
}

}  // namespace

// out[rows, heads, D] = attention of q over each sequence's paged K/V (see the top).
void paged_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& query_lens,
                     const at::Tensor& context_lens, double scale, int64_t window) {
  const at::Tensor tables = as_contiguous(block_tables, at::kLong);
  const at::Tensor starts = as_contiguous(query_start, at::kLong);
  const at::Tensor qlens = as_contiguous(query_lens, at::kLong);
  const at::Tensor lens = as_contiguous(context_lens, at::kInt);
  check_attention_inputs(out, q, k_cache, v_cache, tables, starts, qlens, lens);
  auto launch = [&](auto zero) {
    using T = decltype(zero);
    auto p = make_problem<T>(out, q, k_cache, v_cache, tables, starts, qlens, lens, scale, window);
    dispatch_head_dim(p, q.size(2), make_items(p, lens.size(0)), HeadDims{});
  };
  switch (q.scalar_type()) {
    case at::kFloat: return launch(float{});
    case at::kBFloat16: return launch(at::BFloat16{});
    case at::kHalf: return launch(at::Half{});
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}

std::vector<int64_t> supported_head_dims() { return head_dims(HeadDims{}); }

// Which vector ISA the kernel was compiled for (for logs and benchmarks).
std::string vector_isa() {
#if defined(CPU_CAPABILITY_AVX512)
  return "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "avx2";
#else
  return "default";
#endif
}

}  // namespace kvserve
