"""int8 K/V: asymmetric 8-bit per (token, KV head), a scale and a zero point each.

Each (token, KV head) row of `head_dim` values is stored as `head_dim` uint8 codes followed
by its scale and its minimum as two fp32 (8 bytes), so an int8 pool keeps the layout of the
others, [2, blocks, block_size, kv_heads, head_dim + 8] in uint8, and every block move
(copy-on-write, tiers, transfer) copies a block's codes and scales together as bytes.

Asymmetric per (token, head) rather than symmetric: on SmolLM2 it halves the KL divergence
against fp32 K/V and keeps perplexity (issue #49's measurement); per-channel K would need a
block full before its scales are known. The kernels quantize with the same fp32 operations in
the same order (`inv = 255 / (max - min)`, `code = rint((x - min) * inv)`, half to even), so
codes written in C++ equal these bit for bit.
"""

from __future__ import annotations

import torch

SCHEME = "asym-u8-token-head"  # enters the tier namespace: a record of another scheme is a miss
SCALE_BYTES = 8  # fp32 scale, fp32 minimum


def stored_head_dim(head_dim: int) -> int:
    """The last dimension of an int8 pool."""
    return head_dim + SCALE_BYTES


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> [..., head_dim + 8] uint8 (codes, then scale and minimum)."""
    xf = x.float()
    lo = xf.amin(-1, keepdim=True)
    span = xf.amax(-1, keepdim=True) - lo
    flat = span == 0  # a constant row: every code 0, any scale
    inv = torch.where(flat, torch.zeros_like(span), 255.0 / torch.where(flat, torch.ones_like(span), span))
    codes = torch.round((xf - lo) * inv).clamp_(0, 255).to(torch.uint8)
    scale = span / 255.0
    tail = torch.cat([scale, lo], -1).contiguous().view(torch.uint8)
    return torch.cat([codes, tail], -1)


def dequantize_kv(stored: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., head_dim + 8] uint8 -> [..., head_dim] in `dtype` (computed in fp32: code * scale + min)."""
    codes = stored[..., :-SCALE_BYTES].float()
    scale_min = stored[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (codes * scale_min[..., :1] + scale_min[..., 1:]).to(dtype)
