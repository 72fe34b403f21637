"""Linear layers with their weights pre-packed once for oneDNN (CPU).

`F.linear` in bf16 re-lays the weight out for oneDNN's AMX/AVX-512 kernels on every
call; at decode batch sizes that costs more than the multiply (a 960x576 projection:
71 us, of which 33 us is the repacking). Packing once at load makes every projection
1.4-1.9x faster at batch 1-64 with identical results. fp32 goes through oneDNN too: on
an AMD CPU (AVX2) MKL's sgemm, which `F.linear` calls, ran 30 SmolLM2 layers at 8 rows
in 145 ms against oneDNN's 54 (41 vs 33 at 1 row, 224 vs 131 at 32), and the head at
8 rows in 48 vs 11 ms; on the Intel (AMX) host where packing was first measured, fp32
gained nothing.

Decode batches and prefill chunks go further: oneDNN reads cold weights at a third of
the machine's bandwidth, so up to `SmallBatchWeight.max_rows` rows kvserve's own kernel
(`kvserve/csrc/small_batch_linear.cpp`: bf16 on AMX or AVX512-BF16, fp32 on AVX2 in
`small_batch_linear_f32.cpp`) streams a second copy of the weight packed for it. The
weights then take twice their memory, a fair trade for small models on a CPU.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model import cpu_ext

# oneDNN picks a blocked layout per expected batch size; measured: one packing serves
# batches 1-512 within a few percent of the best, so one hint is enough.
BATCH_SIZE_HINT = 64

# Up to how many rows kvserve's kernel beats oneDNN, per ISA (30 SmolLM2 layers, cold
# weights, ms): with AMX 10 vs 16 at 1-16 rows, 18 vs 23 at 64, 31 vs 36 at 192, 78 vs
# 93 at 512, 131 vs 160 at 1,024, but 280 vs 184 at 2,048; with AVX512-BF16 dot products
# alone 9.4 vs 15 at 1-4 rows, even at 8. fp32 on AVX2 (the AMD EPYC host): 19 vs 33 at 1
# row, 29 vs 51 at 8, 93 vs 128 at 32, 1,446 vs 1,644 at 512, but 3,418 vs 3,036 at 1,024.
SMALL_BATCH_MAX_ROWS = {"amx": 1024, "avx512_bf16": 4, "avx2": 512}  # "avx2": the fp32 path
TILE_COLS = 64  # output columns per kernel tile: N is padded to a multiple of this


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """fp32 always; bf16 only where oneDNN multiplies it (AVX-512 or AVX-NE-CONVERT): on an
    AVX2-only CPU its bf16 reorder raises, and bf16 models keep `F.linear`."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def small_batch_isa(dtype: torch.dtype = torch.bfloat16) -> str:
    """kvserve's small-batch kernel for weights of this dtype: 'amx' or 'avx512_bf16' for bf16,
    'avx2' for fp32, or '' where it cannot run."""
    if not cpu_ext.available() or dtype not in (torch.bfloat16, torch.float32):
        return ""
    ops = cpu_ext.load()
    return ops.small_batch_linear_isa() if dtype == torch.bfloat16 else ops.small_batch_linear_f32_isa()


class SmallBatchWeight:
    """A weight packed for kvserve's kernel, N padded to 64 columns: [N/16, K/p, 16, p], p the
    K values per 32-bit lane (bf16: K in pairs; fp32: one)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: str):
        n, k = weight.shape
        per_lane = 4 // weight.element_size()
        w = F.pad(weight.detach(), (0, 0, 0, -n % TILE_COLS))
        self.packed = w.view(-1, 16, k // per_lane, per_lane).permute(0, 2, 1, 3).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = n
        self.use_amx = isa == "amx"
        self.max_rows = SMALL_BATCH_MAX_ROWS[isa]
        self.op = cpu_ext.load().small_batch_linear.default

    @staticmethod
    def fits(weight: torch.Tensor, isa: str) -> bool:
        """fp32 for the AVX2 path; bf16 with K in pairs for the others, in slices of 32 for AMX tiles."""
        if isa == "avx2":
            return weight.dtype == torch.float32
        return bool(isa) and weight.dtype == torch.bfloat16 and weight.shape[1] % (32 if isa == "amx" else 2) == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.out_features)
        self.op(out, x.contiguous(), self.packed, self.bias, self.use_amx)
        return out

    def argmax(self, x: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's argmax of `self(x)` (no bias), without writing `self(x)`: [rows] int64.
        banned: [rows, B] int64 columns each row may not take (-1 pads), as if -inf."""
        assert self.bias is None, "an LM head has no bias"
        ids = torch.empty(x.shape[0], dtype=torch.long)
        cpu_ext.load().small_batch_argmax(ids, x.contiguous(), self.packed, self.out_features, banned, self.use_amx)
        return ids


class PackedLinear(nn.Module):
    """Drop-in for an inference-only `nn.Linear` over 2-D inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: str | None = None):
        super().__init__()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_SIZE_HINT)
        self.bias = None if bias is None else bias.detach()
        isa = small_batch_isa(weight.dtype) if isa is None else isa
        self.small = SmallBatchWeight(weight, bias, isa) if SmallBatchWeight.fits(weight, isa) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._small_fits(x):
            return self.small(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def argmax(self, x: torch.Tensor, banned: torch.Tensor | None = None) -> torch.Tensor | None:
        """Greedy sampling's LM head: each row's argmax of `forward(x)` outside its `banned`
        columns, the logits never written (at 64-128 rows 2-2.7x faster than logits, widening
        and max). None where the small-batch kernel does not take x (or has no fused argmax: fp32)."""
        fused = self._small_fits(x) and self.bias is None and x.dtype == torch.bfloat16
        return self.small.argmax(x, banned) if fused else None

    def _small_fits(self, x: torch.Tensor) -> bool:
        return self.small is not None and x.shape[0] <= self.small.max_rows


def pack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear`; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(linear.weight, linear.bias))
    return len(targets)
