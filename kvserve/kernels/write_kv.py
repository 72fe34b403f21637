"""`csrc/write_kv.cpp`: the new tokens' K/V into the paged cache, in the form it stores them
(copied; rounded to bf16 under fp32 compute; quantized to int8 rows, bit for bit as
`layers/attention/kv_quant.quantize_kv`)."""

from __future__ import annotations

import torch

from kvserve.kernels.build import load


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] into `kv_cache` [2, blocks, block_size, kv_heads, stored dim] at `slots`."""
    load().write_kv(k, v, kv_cache, slots)
