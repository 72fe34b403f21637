// Every op and class of kvserve's CPU extension, registered in one place as torch.ops.kvserve.*
// and torch.classes.kvserve.* (the Python side: kvserve/kernels/build.py loads the library).

#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(kvserve, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &kvserve::rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &kvserve::fused_add_rms_norm);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &kvserve::silu_and_mul);
  m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos_sin) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &kvserve::rotary_embedding);

  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor query_lens, Tensor context_lens, float scale, int window=0) -> ()");
  m.impl("paged_attention", c10::DispatchKey::CPU, &kvserve::paged_attention);
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &kvserve::write_kv);
  m.def("supported_head_dims() -> int[]", &kvserve::supported_head_dims);
  m.def("vector_isa() -> str", &kvserve::vector_isa);
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor query_start, Tensor query_lens, Tensor context_lens, float scale, int window, bool use_amx) -> ()");
  m.impl("prefill_attention", c10::DispatchKey::CPU, &kvserve::prefill_attention);

  m.def("small_batch_linear(Tensor(a!) out, Tensor x, Tensor packed_weight, Tensor? bias, bool use_amx) -> ()");
  m.impl("small_batch_linear", c10::DispatchKey::CPU, &kvserve::small_batch_linear);
  m.def("small_batch_argmax(Tensor(a!) token_ids, Tensor x, Tensor packed_weight, int n, Tensor? banned, "
        "bool use_amx) -> ()");
  m.impl("small_batch_argmax", c10::DispatchKey::CPU, &kvserve::small_batch_argmax);
  m.def("small_batch_linear_isa() -> str", &kvserve::small_batch_linear_isa);
  m.def("small_batch_linear_f32_isa() -> str", &kvserve::small_batch_linear_f32_isa);

  m.def("scatter_blocks", &kvserve::scatter_blocks);
  m.def("gather_blocks", &kvserve::gather_blocks);
  m.def("copy_blocks", &kvserve::copy_blocks);

  kvserve::register_decoder_layers(m);
}
