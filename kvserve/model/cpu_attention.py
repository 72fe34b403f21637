"""CPU paged attention: a compiled kernel that reads K/V in place through block tables.

`TorchAttention` copies every request's K/V blocks into a padded tensor per layer per
step before SDPA; on the CPU that copy costs more than the attention itself. The
kernel in `kvserve/csrc/paged_attention.cpp` walks the block tables instead, reading
each K/V row once. It is part of kvserve's CPU extension (`cpu_ext`); where that does
not build, the engine keeps using `TorchAttention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.model.attention import AttentionBackend, AttentionMetadata, PrefillSeq, TorchAttention, write_kv
from kvserve.model.cpu_ext import available, load

# Prefill chunks up to this many queries go to the kernel: its per-key dot products beat
# SDPA's matmuls on short chunks, while on longer ones SDPA's flash kernel (bf16 via AMX)
# wins, once it is called with 4-D inputs (3-D ones take SDPA's much slower math path).
# Measured on SmolLM2 shapes: crossover at ~16-24 queries in bf16, ~32-48 in fp32.
KERNEL_MAX_PREFILL_QUERIES = 16


def supports(head_dim: int) -> bool:
    """The kernel is compiled for a few head dims; others use TorchAttention."""
    return available() and head_dim in load().supported_head_dims()


def select_backend(device: torch.device, head_dim: int) -> AttentionBackend:
    """CpuPagedAttention on the CPU where the kernel builds and has this head_dim, else TorchAttention."""
    if device.type == "cpu" and supports(head_dim):
        return CpuPagedAttention()
    return TorchAttention()


@dataclass
class _KernelBatch:
    """The rows of one step that the kernel computes, as its arguments (built once per step)."""

    block_tables: torch.Tensor  # [seqs, max_blocks] int64
    query_start: torch.Tensor  # [seqs] int64: first row in the flat batch
    query_lens: torch.Tensor  # [seqs] int64
    context_lens: torch.Tensor  # [seqs] int32
    torch_prefills: list[PrefillSeq]  # left to TorchAttention


class CpuPagedAttention:
    """`AttentionBackend` for the CPU: the kernel for decodes and short prefill chunks (all
    in one call), TorchAttention's SDPA for long prefill chunks, where matmuls win."""

    def __init__(self, max_prefill_queries: int = KERNEL_MAX_PREFILL_QUERIES) -> None:
        self.ops = load()
        self.max_prefill_queries = max_prefill_queries
        self._batch_meta: AttentionMetadata | None = None  # every layer of a step shares one meta
        self._batch: _KernelBatch | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty_like(q)
        batch = self._plan(meta)
        if batch.query_lens.numel():
            self.ops.paged_attention(
                out, q, kv_cache[0], kv_cache[1], batch.block_tables,
                batch.query_start, batch.query_lens, batch.context_lens, 1.0 / math.sqrt(q.shape[-1]),
            )  # fmt: skip
        for seq in batch.torch_prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = TorchAttention._prefill(q[rows], k[rows], v[rows], kv_cache, seq)
        return out.flatten(1)

    def _plan(self, meta: AttentionMetadata) -> _KernelBatch:
        if self._batch_meta is not meta:
            self._batch, self._batch_meta = kernel_batch(meta, self.max_prefill_queries), meta
        return self._batch


def kernel_batch(meta: AttentionMetadata, max_prefill_queries: int = KERNEL_MAX_PREFILL_QUERIES) -> _KernelBatch:
    """Decodes (rows 0..nd of the flat batch) and the short prefill chunks, for one call."""
    nd = meta.num_decode_tokens
    short = [s for s in meta.prefills if s.query_len <= max_prefill_queries]
    starts = list(range(nd)) + [s.query_start for s in short]
    qlens = [1] * nd + [s.query_len for s in short]
    ctx = meta.decode_context_lens[:nd].tolist() + [s.context_len for s in short]
    return _KernelBatch(
        block_tables=_stack_tables(meta.decode_block_tables[:nd], [s.block_table for s in short]),
        query_start=torch.tensor(starts, dtype=torch.int64),
        query_lens=torch.tensor(qlens, dtype=torch.int64),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        torch_prefills=[s for s in meta.prefills if s.query_len > max_prefill_queries],
    )


def _stack_tables(decode: torch.Tensor, prefill: list[torch.Tensor]) -> torch.Tensor:
    """One [seqs, max_blocks] table (padded with block 0, never read past a context)."""
    if not prefill:
        return decode
    width = max([decode.shape[1] if decode.numel() else 0] + [t.numel() for t in prefill])
    table = torch.zeros(decode.shape[0] + len(prefill), width, dtype=torch.int64)
    table[: decode.shape[0], : decode.shape[1]] = decode
    for i, t in enumerate(prefill, start=decode.shape[0]):
        table[i, : t.numel()] = t
    return table
