"""Decode steps through kvserve's C++ layer loop (`kvserve/csrc/decoder.cpp`).

The Python layers cost ~4 ms of interpreter time per step on SmolLM2 (30 layers x ~10
small ops); the C++ loop runs the same kernels in the same order without it. It takes
a step only when every op of it has a kernel there: bf16 weights packed for the
small-batch linear, at most its row limit of tokens, every query row handled by the
paged-attention kernel (decodes and short prefill chunks), no q/k norm. Anything else
(long prefill chunks, fp32, other devices) runs the Python layers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvserve.model import cpu_ext
from kvserve.model.attention import AttentionMetadata
from kvserve.model.cpu_attention import CpuPagedAttention, kernel_batch
from kvserve.model.layer_ops import CpuLayerOps

if TYPE_CHECKING:
    from kvserve.model.llama import LlamaForCausalLM


class FusedDecoderLayers:
    def __init__(self, model: LlamaForCausalLM):
        cfg = model.config
        layers = list(model.layers)
        attn = [layer.self_attn for layer in layers]
        linears = [m for layer in layers for m in _linears(layer)]
        self.backend: CpuPagedAttention = attn[0].backend
        self.max_rows = min(m.small.max_rows for m in linears)
        self.use_amx = linears[0].small.use_amx
        self.weights = (
            [layer.input_layernorm.weight for layer in layers],
            [a.qkv_proj.small.packed for a in attn],
            [a.qkv_proj.small.bias for a in attn],
            [a.o_proj.small.packed for a in attn],
            [layer.post_attention_layernorm.weight for layer in layers],
            [layer.mlp.gate_up_proj.small.packed for layer in layers],
            [layer.mlp.down_proj.small.packed for layer in layers],
        )
        self.shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
        self.eps, self.scale = cfg.rms_norm_eps, 1.0 / math.sqrt(cfg.head_dim)
        self.op = cpu_ext.load().decoder_layers.default

    @staticmethod
    def create(model: LlamaForCausalLM) -> FusedDecoderLayers | None:
        """The loop for this model, or None where some op of it has no kernel."""
        attn = model.layers[0].self_attn
        usable = (
            isinstance(attn.backend, CpuPagedAttention)
            and isinstance(attn.ops, CpuLayerOps)
            and attn.q_norm is None
            and all(getattr(m, "small", None) is not None for layer in model.layers for m in _linears(layer))
            and hasattr(cpu_ext.load(), "decoder_layers")
        )
        return FusedDecoderLayers(model) if usable else None

    def runs(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """Whether this step fits the loop (else the Python layers run it)."""
        limit = self.backend.max_prefill_queries
        return num_tokens <= self.max_rows and all(s.query_len <= limit for s in meta.prefills)

    def __call__(
        self, x: torch.Tensor, cos_sin: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's MLP output, residual), as the Python layer loop returns them."""
        batch = kernel_batch(meta, self.backend.max_prefill_queries)
        return self.op(
            x, cos_sin, *self.weights, kv_caches, meta.slot_mapping,
            batch.block_tables, batch.query_start, batch.query_lens, batch.context_lens,
            *self.shape, self.eps, self.scale, self.use_amx,
        )  # fmt: skip


def _linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
