"""`csrc/prefill_attention.cpp`: flash attention for prefill chunks of bf16 models on AMX
tiles, reading the pages in place."""

from __future__ import annotations

import torch

from kvserve.kernels.build import available, load
from kvserve.kernels.paged_attention import KernelRows


def supports(head_dim: int) -> bool:
    """AMX only (the bf16 small-batch kernel says whether Linux grants it); head dims that
    are multiples of 32 up to 256."""
    return available() and load().small_batch_linear_isa() == "amx" and head_dim % 32 == 0 and head_dim <= 256


def prefill_attention(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, rows: KernelRows, scale: float, window: int = 0
) -> None:
    """As `paged_attention`, on AMX tiles; window > 0: each query sees its last `window` keys."""
    load().prefill_attention(out, q, kv_cache[0], kv_cache[1], *rows.args(), scale, window)
