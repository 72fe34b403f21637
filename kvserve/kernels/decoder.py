"""`csrc/decoder.cpp`: a step's decoder layers in one C++ call (`torch.classes.kvserve.DecoderLayers`).

The loop runs the kernels the Python layers call, in the same order with the same
roundings, minus the interpreter between them. A model hands it each layer's weights
as `LayerWeights`; the CPU platform decides whether it runs (`kvserve/platforms/cpu.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvserve.kernels.build import load


class PackedProjection(Protocol):
    """A projection packed for oneDNN (`packed_weight`) and, where it fits, for the
    small-batch kernel (`small`: a `SmallBatchWeight` or None)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None
    small: Any


@dataclass(frozen=True)
class LayerWeights:
    """One pre-norm decoder layer with fused projections, no q/k norm (Llama, Mistral, Qwen2)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: PackedProjection
    o: PackedProjection
    gate_up: PackedProjection
    down: PackedProjection

    @property
    def projections(self) -> tuple[PackedProjection, ...]:
        return self.qkv, self.o, self.gate_up, self.down


def decoder_layers(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    eps: float,
    layers: list[LayerWeights],
    prefill_amx: bool,
) -> Any:
    """The loop over these layers, their projections all in the small-batch kernel (up to its
    row limit) or all in oneDNN; `prefill_amx`: prefill chunks on AMX tiles, not dot products."""
    load()  # registers torch.classes.kvserve
    small = layers[0].qkv.small  # None: every projection goes to oneDNN
    loop = torch.classes.kvserve.DecoderLayers(
        num_heads, num_kv_heads, head_dim, intermediate_size, eps,
        small.max_rows if small else 0, bool(small and small.use_amx), prefill_amx,
    )  # fmt: skip
    no_small = torch.empty(0)
    for layer in layers:
        linears = layer.projections
        loop.add_layer(
            layer.input_norm, layer.post_attention_norm,
            [m.small.packed if small else no_small for m in linears], [m.packed_weight for m in linears],
            layer.qkv.small.bias if small else None, layer.qkv.bias,
        )  # fmt: skip
    return loop
