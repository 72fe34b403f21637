"""The element-wise parts of a decoder layer: RMSNorm (optionally adding the residual
first), SiLU-and-multiply and rotary embedding, in PyTorch or as fused CPU kernels.

`TorchLayerOps` is the reference and runs anywhere; `kvserve.kernels.layer_ops.CpuLayerOps`
has the same methods as fused CPU kernels. The platform picks one (`LayerOps`) and the
model's layers call it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TorchLayerOps:
    @staticmethod
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(normalised, new residual): with a residual, normalises x + residual and returns that sum too."""
        if residual is not None:
            x = residual = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half rotary embedding; cos_sin [T, D] is each token's cos then sin."""
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
