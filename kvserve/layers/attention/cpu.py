"""CPU paged attention: compiled kernels that read K/V in place through block tables.

`TorchAttention` copies every request's K/V blocks into a padded tensor per layer per
step before SDPA; on the CPU that copy costs more than the attention itself. The
kernel in `kvserve/kernels/csrc/paged_attention.cpp` walks the block tables instead, reading
each K/V row once. Prefill chunks past a few queries go to a second kernel
(`kvserve/kernels/csrc/prefill_attention.cpp`), flash attention that also reads the pages in
place: for bf16 models on the AMX tile unit or with `vdpbf16ps` dot products (on AMX 1.5-3x
faster than SDPA on a gathered copy of the context), for fp32 models on AVX2 hosts with FMAs.
Both are part of kvserve's CPU extension (`kvserve/kernels`); where that does not build,
the CPU platform keeps `TorchAttention`. Both also read K/V stored in another form than the
compute dtype (bf16 under fp32, int8 rows under either), widening rows in place of a cast
copy; with such a cache no chunk goes to SDPA (which would need that copy): without a
prefill kernel the paged kernel takes every chunk.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from kvserve.kernels.paged_attention import KernelRows, paged_attention
from kvserve.kernels.prefill_attention import DTYPES, prefill_attention
from kvserve.kernels.write_kv import write_kv
from kvserve.layers.attention.backend import AttentionMetadata, PrefillSeq, TorchAttention

# Prefill chunks up to this many queries go to the paged kernel, by the prefill kernel the
# CPU has. AMX's tiles beat the paged kernel on every chunk. Without a prefill kernel (fp16;
# fp32 where the kernels are not built for AVX2), the paged kernel's per-key dot products beat
# SDPA's matmuls on short chunks (crossover at ~16-24 queries in bf16, ~32-48 in fp32,
# SmolLM2 shapes); longer chunks go to SDPA's flash kernel (called with 4-D inputs: 3-D ones
# take SDPA's much slower math path). The dot-product prefill kernel (AVX512-BF16, no AMX:
# AMD Zen 4 and 5) beat the paged kernel on a Zen 5 from ~4 queries (SmolLM2, 1,000 cached:
# 0.13 vs 0.18 ms at 16 new, 0.10 vs 0.08 at 4; Gemma 3 from 4). A Zen 4 (512-bit operations
# at half rate) is not measured; on an AMX Xeon with AMX withheld the paged kernel won to 16.
# The fp32 prefill kernel (AVX2, Zen 1) beat the paged kernel from ~8-16 queries after a
# cached prefix, from ~100 on SmolLM2's fresh prompts and ~16 on Gemma 3's, and SDPA from
# ~16-64 (fresh) or everywhere (cached prefix).
KERNEL_MAX_PREFILL_QUERIES = {"": 16, "avx512_bf16": 4, "amx": 0, "f32": 8}


@dataclass
class KernelBatch:
    """A step's attention plan (built once per step, shared by every layer)."""

    paged: KernelRows  # decodes, and the chunks up to the limit
    chunks: KernelRows | None  # prefill chunks for the prefill kernel
    torch_prefills: list[PrefillSeq]  # left to TorchAttention


class CpuPagedAttention:
    """`AttentionBackend` for the CPU: the paged kernel for decodes; for the prefill chunks of a
    model whose dtype is `prefill_kernel`'s ("amx" or "avx512_bf16" for bf16, "f32" for fp32:
    `kernels.prefill_attention.isa(dtype)`), the prefill kernel for the chunks past the limit
    (`KERNEL_MAX_PREFILL_QUERIES`: none on AMX); elsewhere the paged kernel for short chunks and
    TorchAttention's SDPA for long ones, where matmuls win."""

    def __init__(self, max_prefill_queries: int | None = None, prefill_kernel: str = "") -> None:
        self.max_prefill_queries = max_prefill_queries  # None: KERNEL_MAX_PREFILL_QUERIES for the kernel used
        self.prefill_kernel = prefill_kernel

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
        batch = self.plan(meta, q.dtype, kv_cache.shape[2], kv_cache.dtype)
        scale = 1.0 / math.sqrt(q.shape[-1])
        window = meta.sliding_window or 0
        if batch.paged.query_lens.numel():
            paged_attention(out, q, kv_cache, batch.paged, scale, window)
        if batch.chunks is not None:
            prefill_attention(out, q, kv_cache, batch.chunks, scale, window, use_amx=self.prefill_kernel == "amx")
        for seq in batch.torch_prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = TorchAttention._prefill(q[rows], k[rows], v[rows], kv_cache, seq)
        return out.flatten(1)

    def plan(self, meta: AttentionMetadata, dtype: torch.dtype, block_size: int, kv_dtype: torch.dtype) -> KernelBatch:
        """Once per metadata (every layer of a KV group shares one in a step), kept on it."""
        if not isinstance(meta.backend_state, KernelBatch):
            usable = DTYPES.get(self.prefill_kernel) == dtype and block_size % 16 == 0
            kernel = self.prefill_kernel if usable else ""
            limit = self.max_prefill_queries
            if not kernel and kv_dtype != dtype:  # SDPA would need a cast copy: the paged kernel
                limit = sys.maxsize
            meta.backend_state = kernel_batch(meta, limit, kernel)
        return meta.backend_state


def kernel_batch(meta: AttentionMetadata, max_prefill_queries: int | None, prefill_kernel: str) -> KernelBatch:
    """Decodes (rows 0..nd of the flat batch), then the prefill chunks, split between the kernels:
    those up to the limit (`max_prefill_queries`, else the kernel's default) to the paged kernel."""
    nd = meta.num_decode_tokens
    short_max = KERNEL_MAX_PREFILL_QUERIES[prefill_kernel] if max_prefill_queries is None else max_prefill_queries
    short = [s for s in meta.prefills if s.query_len <= short_max]
    rest = [s for s in meta.prefills if s.query_len > short_max]
    context_lens = meta.decode_context_lens[:nd].tolist() + [s.context_len for s in short]
    paged = KernelRows(
        block_tables=_stack_tables(meta.decode_block_tables[:nd], [s.block_table for s in short]),
        query_start=torch.tensor(list(range(nd)) + [s.query_start for s in short], dtype=torch.int64),
        query_lens=torch.tensor([1] * nd + [s.query_len for s in short], dtype=torch.int64),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
    )
    chunks = _chunk_rows(rest) if prefill_kernel and rest else None
    return KernelBatch(paged, chunks, [] if prefill_kernel else rest)


def _chunk_rows(prefills: list[PrefillSeq]) -> KernelRows:
    return KernelRows(
        block_tables=_stack_tables(torch.empty(0, 0, dtype=torch.int64), [s.block_table for s in prefills]),
        query_start=torch.tensor([s.query_start for s in prefills], dtype=torch.int64),
        query_lens=torch.tensor([s.query_len for s in prefills], dtype=torch.int64),
        context_lens=torch.tensor([s.context_len for s in prefills], dtype=torch.int32),
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
