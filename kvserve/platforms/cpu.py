"""The CPU platform: kvserve's compiled kernels where they build and fit, PyTorch elsewhere.

- attention: `CpuPagedAttention` (the paged kernel; with AVX512-BF16 the prefill kernel too) for
  the head dims the kernel is compiled for;
- element-wise ops: the fused kernels of `kernels/layer_ops` for fp32 and bf16;
- whole KV blocks to and from the tiers: `kernels/block_copy`;
- projections: pre-packed for oneDNN where it multiplies the dtype, and for kvserve's
  small-batch kernel where the CPU has a path for it, that copy on huge pages (`huge_pages`);
- the C++ layer loop (`kernels/decoder`) where every op of a layer has a kernel and the
  model describes its layers (`decoder_layer_weights`). The Python layers cost ~6 ms of
  interpreter time per step on SmolLM2 (30 layers x ~10 small ops), and the cache
  traffic it brings between kernels; the loop runs the same kernels in the same order
  without it, bit for bit.

Where the kernels do not build (or `KVSERVE_CPU_KERNEL=0`), everything is PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvserve.kernels import paged_attention, prefill_attention
from kvserve.kernels.block_copy import HostBlockCopy
from kvserve.kernels.build import available
from kvserve.kernels.decoder import LayerWeights, decoder_layers
from kvserve.kernels.layer_ops import CpuLayerOps
from kvserve.layers.attention.backend import AttentionBackend, AttentionMetadata, TorchAttention
from kvserve.layers.attention.cpu import CpuPagedAttention
from kvserve.layers.layer_ops import LayerOps, TorchLayerOps
from kvserve.layers.linear import PackedLinear, can_pack
from kvserve.logger import logger
from kvserve.platforms.huge_pages import move_to_huge_pages
from kvserve.platforms.interface import Platform

# The KV cache dtypes the kernels read under each compute dtype (others: only their own);
# uint8 is int8 K/V (layers/attention/kv_quant.py's rows of codes, scale and minimum).
KERNEL_KV_DTYPES = {
    torch.float32: (torch.float32, torch.bfloat16, torch.uint8),
    torch.bfloat16: (torch.bfloat16, torch.uint8),
}


@dataclass
class CpuPlatform(Platform):
    def reads_kv(self, kv_dtype: torch.dtype) -> bool:
        # without the kernels the PyTorch path is the fastest, and it reads any
        return self._kernels_read(kv_dtype) or not available()

    def _kernels_read(self, kv_dtype: torch.dtype) -> bool:
        """The kernels (and the C++ loop) read K/V of the compute dtype, bf16 under fp32 and int8
        under either (widened or dequantized as they read)."""
        return kv_dtype in KERNEL_KV_DTYPES.get(self.dtype, (self.dtype,))

    def attention_backend(self, head_dim: int) -> AttentionBackend:
        if not self._kernels_read(self.kv_dtype):  # the PyTorch path casts
            return TorchAttention()
        if paged_attention.supports(head_dim):
            supported = prefill_attention.supports(head_dim, self.dtype)
            prefill = prefill_attention.isa(self.dtype) if supported else ""
            return CpuPagedAttention(prefill_kernel=prefill)
        return TorchAttention()

    def layer_ops(self) -> LayerOps:
        return CpuLayerOps() if self._fused_ops() else TorchLayerOps()

    def block_copy(self) -> HostBlockCopy | None:
        return HostBlockCopy() if available() else None

    def _fused_ops(self) -> bool:
        return self.dtype in (torch.float32, torch.bfloat16) and available()

    def prepare(self, model: nn.Module) -> None:
        """Round the matrices to `weight_dtype`, pack the projections (and the head) once, then run
        the layers in C++ where every op can."""
        if self.weight_dtype != self.dtype:
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:  # matrices: projections, embeddings (norms stay fp32)
                        p.copy_(p.to(self.weight_dtype))
        if not can_pack(self.dtype, self.device):
            return
        model.pack_linears()
        small = [m.small for m in model.modules() if isinstance(m, PackedLinear) and m.small is not None]
        if small:
            moved, pages = move_to_huge_pages(small)
            logger.info("small-batch weights: %.0f MB on %s", moved / 1e6, pages)
        model.layer_loop = self.layer_loop(model)

    def layer_loop(self, model: nn.Module) -> CpuLayerLoop | None:
        """The C++ loop for this model, or None where some op of it has no kernel."""
        cfg, layers = model.config, model.decoder_layer_weights()
        backend = self.attention_backend(cfg.head_dim)  # the loop's own planner, as the layers' backend plans
        linears = [m for layer in layers or () for m in layer.projections]
        usable = (
            layers is not None
            and isinstance(backend, CpuPagedAttention)
            and self._fused_ops()
            and all(isinstance(m, PackedLinear) for m in linears)
            and len({m.small is None for m in linears}) == 1  # all in the small-batch kernel, or none
        )
        return CpuLayerLoop(cfg, layers, backend) if usable else None


class CpuLayerLoop:
    """A step through every decoder layer in one call (`LlamaForCausalLM.layer_loop`)."""

    def __init__(self, cfg: Any, layers: list[LayerWeights], backend: CpuPagedAttention):
        self.backend = backend  # plans each step's attention as the Python layers' backend would
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per KV head
        self.loop = decoder_layers(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
            layers, backend.prefill_kernel == "amx",
        )  # fmt: skip

    def __call__(
        self, x: torch.Tensor, cos_sin: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's MLP output, residual), as the Python layer loop returns them."""
        batch = self.backend.plan(meta, x.dtype, kv_caches[0].shape[2], kv_caches[0].dtype)
        long, no_bias = batch.torch_prefills, x.new_empty(0)
        return self.loop.forward(
            x, cos_sin, kv_caches, meta.slot_mapping,
            batch.paged.args(), [] if batch.chunks is None else batch.chunks.args(),
            [s.query_start for s in long], [s.query_len for s in long], [s.context_len for s in long],
            [s.block_table for s in long],
            [s.attn_bias(self.groups, x.dtype) if s.cached_prefix else no_bias for s in long],
        )  # fmt: skip
