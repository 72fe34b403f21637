"""`csrc/prefill_attention.cpp`: flash attention for prefill chunks, reading the pages in place:
bf16 on AMX tiles, or with AVX512-BF16 dot products where there is no AMX; fp32 with FMAs."""

from __future__ import annotations

import torch

from kvserve.kernels import small_batch_linear
from kvserve.kernels.build import available, load
from kvserve.kernels.paged_attention import KernelRows

# The activations' dtype of each path.
DTYPES = {"amx": torch.bfloat16, "avx512_bf16": torch.bfloat16, "f32": torch.float32}


def isa(dtype: torch.dtype = torch.bfloat16) -> str:
    """The path for activations of `dtype`: for bf16 'amx' or 'avx512_bf16', the bf16 small-batch
    kernel's (it says whether Linux grants AMX, or KVSERVE_DISABLE_AMX withholds it); for fp32
    'f32' where the kernels are built for AVX2 (the hosts whose dtype "auto" is fp32: the fp32
    path builds for every CPU, but only AVX2's is measured against SDPA); '' where none is taken."""
    if dtype == torch.float32:
        return "f32" if available() and load().vector_isa() == "avx2" else ""
    return small_batch_linear.isa(torch.bfloat16) if dtype == torch.bfloat16 else ""


def supports(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Head dims that are multiples of 32 up to 256, on a CPU with a path for `dtype`."""
    return bool(isa(dtype)) and head_dim % 32 == 0 and head_dim <= 256


def prefill_attention(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, rows: KernelRows, scale: float, window: int,
    use_amx: bool,
) -> None:  # fmt: skip
    """As `paged_attention`; window > 0: each query sees its last `window` keys. bf16 `use_amx`:
    on the tiles (where this process may use AMX), else with the dot products; fp32: FMAs."""
    load().prefill_attention(out, q, kv_cache[0], kv_cache[1], *rows.args(), scale, window, use_amx)
