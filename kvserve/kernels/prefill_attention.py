"""`csrc/prefill_attention.cpp`: flash attention for prefill chunks of bf16 models, reading
the pages in place: on AMX tiles, or with AVX512-BF16 dot products where there is no AMX."""

from __future__ import annotations

import torch

from kvserve.kernels import small_batch_linear
from kvserve.kernels.build import load
from kvserve.kernels.paged_attention import KernelRows


def isa() -> str:
    """'amx' or 'avx512_bf16', the bf16 small-batch kernel's (it says whether Linux grants AMX,
    or KVSERVE_DISABLE_AMX withholds it); '' where the kernel cannot run."""
    return small_batch_linear.isa(torch.bfloat16)


def supports(head_dim: int) -> bool:
    """Head dims that are multiples of 32 up to 256, on a CPU with one of the kernel's paths."""
    return bool(isa()) and head_dim % 32 == 0 and head_dim <= 256


def prefill_attention(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, rows: KernelRows, scale: float, window: int,
    use_amx: bool,
) -> None:  # fmt: skip
    """As `paged_attention`; window > 0: each query sees its last `window` keys. `use_amx`: on
    the tiles (where this process may use AMX), else with the dot products."""
    load().prefill_attention(out, q, kv_cache[0], kv_cache[1], *rows.args(), scale, window, use_amx)
