"""`csrc/layer_ops.cpp`: a decoder layer's element-wise ops as fused CPU kernels.

`CpuLayerOps` has the methods of `kvserve.layers.layer_ops.TorchLayerOps` (the reference)
and rounds intermediates where it does: a decode step at batch 1 spends more time
dispatching the PyTorch versions' small ops than computing.
"""

from __future__ import annotations

import torch

from kvserve.kernels.build import load


class CpuLayerOps:
    def __init__(self) -> None:
        self.ops = load()

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty_like(x)
        if residual is None:
            self.ops.rms_norm(out, x, weight, eps)
        else:
            self.ops.fused_add_rms_norm(out, x, residual, weight, eps)  # residual += x, in place
        return out, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], x.shape[1] // 2)
        self.ops.silu_and_mul(out, x)
        return out

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.ops.rotary_embedding(q, k, cos_sin)  # in place
        return q, k
