"""Steps through kvserve's C++ layer loop (`kvserve/csrc/decoder.cpp`).

The Python layers cost ~6 ms of interpreter time, and the cache traffic it brings
between kernels, per step on SmolLM2 (30 layers x ~10 small ops); the C++ loop runs
the same kernels in the same order without it, bit for bit. It needs every op to have
a kernel there: projections packed for oneDNN (and for kvserve's small-batch kernel where
the CPU has a path for their dtype), the CPU paged-attention backend and fused layer ops,
no q/k norm.
Models that lack one (other devices, Qwen3, bf16 where oneDNN has no bf16) run the Python
layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.model import cpu_ext
from kvserve.model.attention import AttentionMetadata
from kvserve.model.cpu_attention import CpuPagedAttention
from kvserve.model.layer_ops import CpuLayerOps
from kvserve.model.packed_linear import PackedLinear

if TYPE_CHECKING:
    from kvserve.model.llama import DecoderLayer, LlamaForCausalLM


class FusedDecoderLayers:
    def __init__(self, model: LlamaForCausalLM):
        cfg, layers = model.config, list(model.layers)
        small = layers[0].self_attn.qkv_proj.small  # None: every projection goes to oneDNN
        no_small = torch.empty(0)
        self.backend: CpuPagedAttention = layers[0].self_attn.backend
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads  # query heads per KV head
        cpu_ext.load()  # registers torch.classes.kvserve
        self.loop = torch.classes.kvserve.DecoderLayers(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
            cfg.rms_norm_eps, small.max_rows if small else 0, bool(small and small.use_amx),
        )  # fmt: skip
        for layer in layers:
            linears = _linears(layer)
            qkv = linears[0]
            self.loop.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                [m.small.packed if small else no_small for m in linears], [m.packed_weight for m in linears],
                qkv.small.bias if small else None, qkv.bias,
            )  # fmt: skip

    @staticmethod
    def create(model: LlamaForCausalLM) -> FusedDecoderLayers | None:
        """The loop for this model, or None where some op of it has no kernel."""
        attn = model.layers[0].self_attn
        linears = [m for layer in model.layers for m in _linears(layer)]
        usable = (
            isinstance(attn.backend, CpuPagedAttention)
            and isinstance(attn.ops, CpuLayerOps)
            and attn.q_norm is None
            and all(isinstance(m, PackedLinear) for m in linears)
            and len({m.small is None for m in linears}) == 1  # all in the small-batch kernel, or none
        )
        return FusedDecoderLayers(model) if usable else None

    def __call__(
        self, x: torch.Tensor, cos_sin: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's MLP output, residual), as the Python layer loop returns them."""
        batch = self.backend.plan(meta, x.dtype, kv_caches[0].shape[2])
        long, no_bias = batch.torch_prefills, x.new_empty(0)
        return self.loop.forward(
            x, cos_sin, kv_caches, meta.slot_mapping,
            batch.paged.args(), [] if batch.chunks is None else batch.chunks.args(),
            [s.query_start for s in long], [s.query_len for s in long], [s.context_len for s in long],
            [s.block_table for s in long],
            [s.attn_bias(self.groups, x.dtype) if s.cached_prefix else no_bias for s in long],
        )  # fmt: skip


def _linears(layer: DecoderLayer) -> tuple[torch.nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
