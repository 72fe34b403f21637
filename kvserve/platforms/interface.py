"""A platform: the device and dtype a model runs in, and which implementation of each op
it gets there. The base class is pure PyTorch and runs on any device (CUDA included);
`CpuPlatform` swaps in kvserve's compiled kernels where they run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvserve.kernels.block_copy import HostBlockCopy
from kvserve.layers.attention.backend import AttentionBackend, TorchAttention
from kvserve.layers.layer_ops import LayerOps, TorchLayerOps


@dataclass
class Platform:
    device: torch.device
    dtype: torch.dtype  # activations
    weight_dtype: torch.dtype | None = None  # what the matrices' values are rounded to (None: dtype)
    kv_dtype: torch.dtype | None = None  # how K/V are stored (None: dtype)

    def __post_init__(self) -> None:
        self.weight_dtype = self.weight_dtype or self.dtype
        self.kv_dtype = self.kv_dtype or self.dtype

    def reads_kv(self, kv_dtype: torch.dtype) -> bool:
        """Whether this platform's fastest attention path reads K/V stored as `kv_dtype` under
        its compute dtype. The PyTorch path reads any (it casts what it gathers), bf16 on a GPU
        only where the GPU has it."""
        return kv_dtype != torch.bfloat16 or self.device.type != "cuda" or torch.cuda.is_bf16_supported()

    def attention_backend(self, head_dim: int) -> AttentionBackend:
        return TorchAttention()

    def layer_ops(self) -> LayerOps:
        return TorchLayerOps()

    def block_copy(self) -> HostBlockCopy | None:
        """The copier of whole KV blocks, between the pool and the tiers' bytes and within the
        pool, where the pool is host memory and a kernel does it; None: torch does them."""
        return None

    def prepare(self, model: nn.Module) -> None:
        """After loading: whatever makes the model faster here without changing its outputs
        (beyond the rounding to `weight_dtype`)."""
