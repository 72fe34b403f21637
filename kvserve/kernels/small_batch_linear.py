"""`csrc/small_batch_linear.cpp`: kvserve's matmul for decode batches and prefill chunks.

oneDNN reads cold weights at a third of the machine's bandwidth at small batch sizes;
up to `SmallBatchWeight.max_rows` rows this kernel streams a second copy of the weight,
packed for it: bf16 on AMX tiles or AVX512-BF16 dot products, fp32 on AVX2 and FMA
(`small_batch_linear_f32.cpp`). For greedy sampling's LM head it also keeps each row's
running argmax, so the logits are never written.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvserve.kernels import small_batch_linear_f32
from kvserve.kernels.build import available, load

# Up to how many rows this kernel beats oneDNN, per ISA (30 SmolLM2 layers, cold
# weights, ms): with AMX 10 vs 16 at 1-16 rows, 18 vs 23 at 64, 78 vs 93 at 512, 131 vs
# 160 at 1,024, but 280 vs 184 at 2,048; fp32 on AVX2 19 vs 33 at 1 row, 93 vs 128 at 32,
# 1,446 vs 1,644 at 512, but 3,418 vs 3,036 at 1,024. AVX512-BF16 dot products against
# oneDNN without AMX (its avx512_core_bf16 kernels): on an AMD Zen 5, 2 threads, 5.6 vs
# 7.9 at 1 row, 6.4 vs 9.1 at 8, 18.1 vs 22.4 at 64, 47 vs 52 at 192, 61 vs 65 at 256,
# even at 512; on an AMX Xeon with AMX turned off (KVSERVE_DISABLE_AMX=1
# ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, one thread) 22 vs 40 at 1 row, 403 vs 421 at 128,
# even at 256 and 1,024 (tools/bench_linear.py): past a few rows both are bound by the
# same dot products.
SMALL_BATCH_MAX_ROWS = {"amx": 1024, "avx512_bf16": 256, "avx2": 512}  # "avx2": the fp32 path
TILE_COLS = 64  # output columns per kernel tile: N is padded to a multiple of this
# The AVX2 path's bf16 weights: stored position -> column within a group of 16, as the
# kernel's unpacks within 128-bit lanes put them back in order (small_batch_linear_f32.cpp).
BF16_COLUMN_ORDER = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


@functools.cache
def isa(dtype: torch.dtype = torch.bfloat16) -> str:
    """kvserve's small-batch kernel for weights of this dtype: 'amx' or 'avx512_bf16' for bf16,
    'avx2' for fp32, or '' where it cannot run. KVSERVE_DISABLE_AMX=1 (read once, in
    csrc/amx.h, for every AMX kernel) turns 'amx' into 'avx512_bf16'."""
    if not available() or dtype not in (torch.bfloat16, torch.float32):
        return ""
    return load().small_batch_linear_isa() if dtype == torch.bfloat16 else small_batch_linear_f32.isa()


def bf16_paths() -> list[str]:
    """Every bf16 kernel path this process can run, best first: the AVX512-BF16 dot products
    run wherever AMX does (how an AMX host tests a CPU without it)."""
    return {"amx": ["amx", "avx512_bf16"], "avx512_bf16": ["avx512_bf16"]}.get(isa(torch.bfloat16), [])


class SmallBatchWeight:
    """A weight packed for kvserve's kernel, N padded to 64 columns: [N/16, K/p, 16, p], p the
    K values per 32-bit lane (bf16 dot products: K in pairs; the AVX2 path: one, its bf16
    weights widened to fp32 in registers, its columns in BF16_COLUMN_ORDER)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: str):
        n, k = weight.shape
        per_lane = 1 if isa == "avx2" else 4 // weight.element_size()
        w = F.pad(weight.detach(), (0, 0, 0, -n % TILE_COLS)).view(-1, 16, k // per_lane, per_lane)
        if isa == "avx2" and weight.dtype == torch.bfloat16:
            w = w[:, BF16_COLUMN_ORDER]
        self.packed = w.permute(0, 2, 1, 3).contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.out_features = n
        self.use_amx = isa == "amx"
        self.max_rows = SMALL_BATCH_MAX_ROWS[isa]
        self.op = load().small_batch_linear.default

    @staticmethod
    def fits(weight: torch.Tensor, isa: str) -> bool:
        """fp32 or bf16 for the AVX2 path (which computes in fp32); bf16 with K in pairs for the
        others, in slices of 32 for AMX tiles."""
        if isa == "avx2":
            return weight.dtype in (torch.float32, torch.bfloat16)
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
        load().small_batch_argmax(ids, x.contiguous(), self.packed, self.out_features, banned, self.use_amx)
        return ids
