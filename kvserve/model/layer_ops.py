"""The element-wise parts of a decoder layer: RMSNorm (optionally adding the residual
first), SiLU-and-multiply and rotary embedding, in PyTorch or as fused CPU kernels.

`TorchLayerOps` is the reference and runs anywhere; `CpuLayerOps` calls the kernels in
`kvserve/csrc/layer_ops.cpp`, which round intermediates where these functions do (a
decode step at batch 1 spends more time dispatching the PyTorch versions' small ops
than computing). The model picks one at construction with `select_layer_ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.model.cpu_ext import available, load


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


class CpuLayerOps(TorchLayerOps):
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


def select_layer_ops(device: torch.device, dtype: torch.dtype) -> TorchLayerOps:
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and available():
        return CpuLayerOps()
    return TorchLayerOps()
