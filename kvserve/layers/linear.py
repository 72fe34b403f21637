"""Linear layers with their weights pre-packed once for oneDNN (CPU).

`F.linear` in bf16 re-lays the weight out for oneDNN's AMX/AVX-512 kernels on every
call; at decode batch sizes that costs more than the multiply (a 960x576 projection:
71 us, of which 33 us is the repacking). Packing once at load makes every projection
1.4-1.9x faster at batch 1-64 with identical results. fp32 goes through oneDNN too:
where MKL's sgemm, which `F.linear` calls, is slow (AMD CPUs), oneDNN ran 30 SmolLM2
layers at 8 rows in 54 ms against 145, and the LM head in 11 against 48.

Up to `SmallBatchWeight.max_rows` rows a projection goes to kvserve's own kernel
(`kvserve/kernels/small_batch_linear.py`) instead, which streams a second copy of the
weight packed for it. The weights then take twice their memory, a fair trade for small
models on a CPU. On the AVX2 path an fp32 weight whose values are all bf16 ones keeps
that copy in bf16: a decode step is bound by reading the weights, and reads half.
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.small_batch_linear import SmallBatchWeight
from kvserve.kernels.small_batch_linear import isa as small_batch_isa

# oneDNN picks a blocked layout per expected batch size; measured: one packing serves
# batches 1-512 within a few percent of the best, so one hint is enough.
BATCH_SIZE_HINT = 64


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """fp32 always; bf16 only where oneDNN multiplies it (AVX-512 or AVX-NE-CONVERT): on an
    AVX2-only CPU its bf16 reorder raises, and bf16 models keep `F.linear`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """Drop-in for an inference-only `nn.Linear` over 2-D inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: str | None = None):
        super().__init__()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_SIZE_HINT)
        self.bias = None if bias is None else bias.detach()
        isa = small_batch_isa(weight.dtype) if isa is None else isa
        small = bf16_if_exact(weight) if isa == "avx2" else weight
        self.small = SmallBatchWeight(small, bias, isa) if SmallBatchWeight.fits(small, isa) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._small_fits(x):
            return self.small(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def argmax(self, x: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor | None:
        """Greedy sampling's LM head: each row's argmax of `forward(x)` outside its `banned`
        columns, the logits never written (at 64-128 rows 2-2.7x faster than logits, widening
        and max). None where the small-batch kernel does not take x."""
        fused = self._small_fits(x) and self.bias is None
        return self.small.argmax(x, banned) if fused else None

    def _small_fits(self, x: torch.Tensor) -> bool:
        return self.small is not None and x.shape[0] <= self.small.max_rows


def bf16_if_exact(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 weight whose every value is a bf16 one (a bf16 checkpoint, or weights the platform
    rounded) as bf16: the small-batch kernel then reads half the bytes for the same sums."""
    if weight.dtype != torch.float32:
        return weight
    narrow = weight.detach().bfloat16()
    return narrow if torch.equal(narrow.float(), weight) else weight


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(linear.weight, linear.bias))
    return len(targets)
