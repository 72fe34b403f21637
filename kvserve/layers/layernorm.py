"""RMSNorm, with the residual add fused in (vLLM's layout: the residual stream travels
beside the hidden states, and each residual add happens inside the next norm)."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.layers.layer_ops import LayerOps, TorchLayerOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: LayerOps | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops or TorchLayerOps()  # q/k norms keep it: their rows are strided views

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
