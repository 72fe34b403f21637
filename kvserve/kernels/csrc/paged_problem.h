// What both attention kernels (paged_attention.cpp, prefill_attention.cpp) read of one call:
// q / out, the paged K/V caches as stored and, where they hold T, as T, the block tables and
// the sequences' rows; each kernel's Problem adds its own fields to it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace kvserve {

template <typename T>
struct PagedProblem {
  const T* q;
  T* out;
  int64_t q_row, q_head, out_row, out_head;  // strides of q / out [rows, heads, D]
  const T* k;  // the rows the products read: the caches, or null where K/V are staged (widened per tile)
  const T* v;
  int64_t c_block, c_token, c_head, block_size;  // strides of the K and V caches [blocks, block_size, heads, D]
  const char* k_pool;  // the caches as stored, for the prefetches and the staging
  const char* v_pool;
  int64_t pool_elem, row_bytes;  // bytes of a cache element, of one (token, head) row
  at::ScalarType kv_dtype;
  bool staged;  // K/V are stored in another form than T
  const int64_t* tables;
  int64_t table_stride;
  const int64_t* query_start;  // [num_seqs] first row of each sequence in q / out
  const int64_t* query_lens;  // [num_seqs]
  const int32_t* context_lens;  // [num_seqs]
  int64_t group;  // query heads per KV head
  int64_t window;  // sliding window, 0 for none
};

// The shared fields of `p` from the call's tensors (already checked by check_attention_inputs).
template <typename T>
void fill_paged_problem(PagedProblem<T>& p, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& query_start,
                        const at::Tensor& query_lens, const at::Tensor& context_lens, int64_t window) {
  p.q = q.const_data_ptr<T>();
  p.out = out.mutable_data_ptr<T>();
  p.q_row = q.stride(0), p.q_head = q.stride(1), p.out_row = out.stride(0), p.out_head = out.stride(1);
  p.kv_dtype = k_cache.scalar_type();
  p.staged = p.kv_dtype != q.scalar_type();
  p.k_pool = static_cast<const char*>(k_cache.const_data_ptr());
  p.v_pool = static_cast<const char*>(v_cache.const_data_ptr());
  p.k = p.staged ? nullptr : reinterpret_cast<const T*>(p.k_pool);
  p.v = p.staged ? nullptr : reinterpret_cast<const T*>(p.v_pool);
  p.pool_elem = k_cache.element_size(), p.row_bytes = k_cache.size(3) * p.pool_elem;
  p.c_block = k_cache.stride(0), p.c_token = k_cache.stride(1), p.c_head = k_cache.stride(2);
  p.block_size = k_cache.size(1);
  p.tables = tables.const_data_ptr<int64_t>();
  p.table_stride = tables.stride(0);
  p.query_start = query_start.const_data_ptr<int64_t>();
  p.query_lens = query_lens.const_data_ptr<int64_t>();
  p.context_lens = context_lens.const_data_ptr<int32_t>();
  p.group = q.size(1) / k_cache.size(2);
  p.window = window;
}

}  // namespace kvserve
