// Whole KV blocks between the pool and the tiers' bytes, and within the pool (copy-on-write),
// host memory on both sides.
//
// A stored block is [layers, 2 (K, V), block bytes]: each layer's cache is [2, blocks, ...]
// with a block's K (and V) contiguous, so one block is 2 x layers copies of a few KB.
// From Python each such copy cost about as much as the bytes it moved; here they are
// plain copies, blocks spread over the threads. Copies between the pool and the tiers use
// streaming stores: their destination is cold and not read again soon, and a normal store
// first reads each line it writes (a third of the memory traffic of a copy).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "ops.h"

namespace kvserve {
namespace {

// Bytes of one block's K (or V) in every cache, checked to be the same contiguous layout.
int64_t block_bytes(const std::vector<at::Tensor>& caches) {
  TORCH_CHECK(!caches.empty(), "block copy: no KV caches");
  const at::Tensor& first = caches[0];
  for (const at::Tensor& c : caches) {
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.dim() >= 3 && c.size(0) == 2,
                "block copy: each cache must be a contiguous CPU tensor [2, blocks, ...]");
    TORCH_CHECK(c.sizes() == first.sizes() && c.scalar_type() == first.scalar_type(),
                "block copy: the caches must share a shape and dtype");
  }
  return first.stride(1) * static_cast<int64_t>(first.element_size());
}

std::vector<int64_t> checked_ids(const at::Tensor& block_ids, int64_t num_blocks) {
  const at::Tensor ids = as_contiguous(block_ids, at::kLong);
  std::vector<int64_t> out(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
  for (int64_t id : out) TORCH_CHECK(id >= 0 && id < num_blocks, "block copy: block id ", id, " out of range");
  return out;
}

// memcpy(dst, src, n) with non-temporal stores where the destination allows them.
void stream_copy(char* dst, const char* src, int64_t n) {
#if defined(__SSE2__)
  if (n % 64 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0) {
    for (int64_t o = 0; o < n; o += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + o));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + o + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + o + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + o + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + o), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + o + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + o + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + o + 48), d);
    }
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Streaming stores are weakly ordered: they are visible to other threads after this.
void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// copy(i, at, pooled) for each (layer, K or V) part of block ids[i]: `at`, its byte offset in a
// stored block; `pooled`, where it lies in that layer's cache.
template <typename F>
void for_each_part(const std::vector<at::Tensor>& caches, const std::vector<int64_t>& ids, int64_t bb, F copy) {
  at::parallel_for(0, static_cast<int64_t>(ids.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      for (size_t layer = 0; layer < caches.size(); ++layer) {
        auto* base = static_cast<char*>(caches[layer].data_ptr());
        for (int64_t kv = 0; kv < 2; ++kv) {
          char* pooled = base + (kv * caches[layer].size(1) + ids[i]) * bb;
          copy(i, (static_cast<int64_t>(layer) * 2 + kv) * bb, pooled);
        }
      }
    }
    stream_fence();  // by the thread that made the stores
  });
}

}  // namespace

void scatter_blocks(std::vector<at::Tensor> caches, std::vector<at::Tensor> payloads, at::Tensor block_ids) {
  const int64_t bb = block_bytes(caches);
  const std::vector<int64_t> ids = checked_ids(block_ids, caches[0].size(1));
  TORCH_CHECK(payloads.size() == ids.size(), "block copy: one payload per block id");
  const int64_t want = static_cast<int64_t>(caches.size()) * 2 * bb;
  std::vector<const char*> src(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const at::Tensor& p = payloads[i];
    TORCH_CHECK(p.device().is_cpu() && p.is_contiguous() && p.nbytes() == static_cast<size_t>(want),
                "block copy: payload ", i, " has ", p.nbytes(), " bytes, a block has ", want);
    src[i] = static_cast<const char*>(p.data_ptr());
  }
  for_each_part(caches, ids, bb, [&](int64_t i, int64_t at, char* pooled) {
    stream_copy(pooled, src[i] + at, bb);
  });
}

void gather_blocks(std::vector<at::Tensor> outs, std::vector<at::Tensor> caches, at::Tensor block_ids) {
  const int64_t bb = block_bytes(caches);
  const std::vector<int64_t> ids = checked_ids(block_ids, caches[0].size(1));
  TORCH_CHECK(outs.size() == ids.size(), "block copy: one out per block id");
  const int64_t want = static_cast<int64_t>(caches.size()) * 2 * bb;
  std::vector<char*> dst(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const at::Tensor& o = outs[i];
    TORCH_CHECK(o.device().is_cpu() && o.is_contiguous() && o.nbytes() == static_cast<size_t>(want),
                "block copy: out ", i, " has ", o.nbytes(), " bytes, a block has ", want);
    dst[i] = static_cast<char*>(o.data_ptr());
  }
  for_each_part(caches, ids, bb, [&](int64_t i, int64_t at, char* pooled) {
    stream_copy(dst[i] + at, pooled, bb);
  });
}

void copy_blocks(std::vector<at::Tensor> caches, at::Tensor src_ids, at::Tensor dst_ids) {
  const int64_t bb = block_bytes(caches);
  const std::vector<int64_t> src = checked_ids(src_ids, caches[0].size(1));
  const std::vector<int64_t> dst = checked_ids(dst_ids, caches[0].size(1));
  TORCH_CHECK(src.size() == dst.size(), "block copy: as many sources as destinations");
  for (size_t i = 0; i < src.size(); ++i) TORCH_CHECK(src[i] != dst[i], "block copy: block ", src[i], " onto itself");
  // the source part lies in the same cache and K or V half as the destination part
  for_each_part(caches, dst, bb, [&](int64_t i, int64_t, char* pooled) {
    std::memcpy(pooled, pooled + (src[i] - dst[i]) * bb, bb);
  });
}

}  // namespace kvserve
