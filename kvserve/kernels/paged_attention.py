"""`csrc/paged_attention.cpp`: attention for decodes and short prefill chunks, reading K/V
in place through block tables (each K/V row read once, no gathered copy)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kernels.build import available, load


@dataclass
class KernelRows:
    """One kernel call's sequences: where their rows are and their block tables."""

    block_tables: torch.Tensor  # [seqs, max_blocks] int64
    query_start: torch.Tensor  # [seqs] int64: first row in the flat batch
    query_lens: torch.Tensor  # [seqs] int64
    context_lens: torch.Tensor  # [seqs] int32

    def args(self) -> list[torch.Tensor]:
        return [self.block_tables, self.query_start, self.query_lens, self.context_lens]


def supports(head_dim: int) -> bool:
    """The kernel is compiled for a few head dims; others use TorchAttention."""
    return available() and head_dim in load().supported_head_dims()


def paged_attention(
    out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, rows: KernelRows, scale: float, window: int = 0
) -> None:
    """out[rows] = attention of q's rows over each sequence's context in the pool; with a
    window (> 0), each query sees only the keys less than `window` positions before it."""
    load().paged_attention(out, q, kv_cache[0], kv_cache[1], *rows.args(), scale, window)
