"""TorchAttention, the pure-PyTorch backend every device can run (CUDA included)."""

from __future__ import annotations

import torch

from kvserve.engine.model_runner import _decode_tensors, _prefill_seq
from kvserve.layers.attention import backend as attention
from kvserve.layers.attention.backend import AttentionMetadata, TorchAttention

BS = 16


def chunk_after_cached_prefix(prefix: int, n: int, heads: int, kv_heads: int, dim: int):
    g = torch.Generator().manual_seed(0)
    table = torch.arange(1, -(-(prefix + n) // BS) + 1)
    pos = torch.arange(prefix, prefix + n)
    meta = AttentionMetadata(
        slot_mapping=table[pos // BS] * BS + pos % BS,
        num_decode_tokens=0,
        prefills=[_prefill_seq(0, prefix, n, table, BS)],
        **_decode_tensors([], []),
    )
    kv = torch.randn(2, len(table) + 1, BS, kv_heads, dim, generator=g)
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    return q, k, v, kv, meta


def test_cached_prefix_chunk_takes_any_sdpa_output_layout(monkeypatch):
    """CUDA's SDPA hands back [1, H, n, D] laid out as [1, n, H, D]; the query heads folded
    into rows must be unfolded without assuming the CPU's contiguous output."""
    q, k, v, kv, meta = chunk_after_cached_prefix(prefix=40, n=9, heads=6, kv_heads=2, dim=8)
    expected = TorchAttention().forward(q, k, v, kv.clone(), meta)
    sdpa = attention.F.scaled_dot_product_attention

    def sdpa_cuda_layout(*args, **kwargs):
        return sdpa(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa_cuda_layout)
    torch.testing.assert_close(TorchAttention().forward(q, k, v, kv.clone(), meta), expected)
