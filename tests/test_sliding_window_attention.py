"""Sliding-window attention (a key is visible when query_pos - key_pos < window): the
kernels against TorchAttention, and TorchAttention against a dense reference.

The blocks each sequence's window has passed are filled with NaN in the kernels' pool:
a window group's table still names them, but they are back in the pool and hold another
request's K/V, so a kernel that read one would be wrong, and here visibly so.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_cpu_attention import BS, PREFILL_PATHS, assert_prefill_close, make_batch

from kvserve.kernels import build, prefill_attention
from kvserve.layers.attention.backend import TorchAttention
from kvserve.layers.attention.cpu import CpuPagedAttention


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    reason = build.unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU kernels unavailable: {reason}")


def windowed_batch(decode_lens, prefills, window, heads=4, kv_heads=1, head_dim=64, dtype=torch.float32, seed=0):
    """make_batch's random paged batch with every sequence under `window`, and a copy of its
    pool with the blocks before each sequence's window poisoned."""
    q, k, v, kv, meta = make_batch(decode_lens, prefills, heads, kv_heads, head_dim, dtype, seed)
    meta.sliding_window = window
    tables = meta.decode_block_tables.tolist()
    lens = meta.decode_context_lens.tolist()
    for seq in meta.prefills:
        seq.sliding_window = window
    poisoned = kv.clone()
    firsts = [(t, max(0, n - window) // BS) for t, n in zip(tables, lens, strict=True)]
    firsts += [(s.block_table.tolist(), max(0, s.context_len - s.query_len - window + 1) // BS) for s in meta.prefills]
    for table, first in firsts:
        for block in table[:first]:
            poisoned[:, block] = float("nan")
    return q, k, v, kv, poisoned, meta


def dense_reference(q, k, v, kv, meta, window):
    """Each query over its sequence's gathered context with an explicit window mask (float64)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    rows = [(i, 1, int(n), meta.decode_block_tables[i]) for i, n in enumerate(meta.decode_context_lens.tolist())]
    rows += [(s.query_start, s.query_len, s.context_len, s.block_table) for s in meta.prefills]
    kv = kv.clone()
    TorchAttention().forward(q, k, v, kv, meta)  # writes the new K/V into the pool
    group = q.shape[1] // kv.shape[3]
    for start, n, ctx, table in rows:
        keys = kv[0][table].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)  # [ctx, H, D]
        values = kv[1][table].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        pos_q = torch.arange(ctx - n, ctx).unsqueeze(1)
        pos_k = torch.arange(ctx).unsqueeze(0)
        visible = (pos_k <= pos_q) & (pos_q - pos_k < window)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].double(), keys) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start : start + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out.flatten(1)


CASES = [
    # (decode context lengths, prefill chunks as (cached prefix, new tokens), window)
    ([1, 5, 16, 17, 40, 300], [], 16),
    ([600, 513, 512, 1037], [], 512),
    ([], [(0, 40), (5, 12), (100, 9), (130, 3)], 16),  # chunks, short ones the paged kernel's
    ([], [(0, 700), (600, 100), (1000, 24)], 512),  # past the window, and a chunk after a cached prefix
    ([70, 3], [(45, 20), (0, 33)], 7),  # a window that is not a multiple of the block
    ([1037], [], 300),  # one stream: the keys in its window split between the threads
    ([], [(1000, 9)], 130),
]


@pytest.mark.parametrize("decode_lens, prefills, window", CASES)
def test_torch_attention_matches_a_dense_window_mask(decode_lens, prefills, window):
    q, k, v, kv, _, meta = windowed_batch(decode_lens, prefills, window)
    out = TorchAttention().forward(q, k, v, kv.clone(), meta)
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, kv, meta, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode_lens, prefills, window", CASES)
def test_paged_kernel_float32_matches_and_never_reads_past_the_window(decode_lens, prefills, window):
    q, k, v, kv, poisoned, meta = windowed_batch(decode_lens, prefills, window)
    backend = CpuPagedAttention(max_prefill_queries=64)  # chunks up to 64 go to the paged kernel
    out = backend.forward(q, k, v, poisoned, meta)
    assert not out.isnan().any()
    ref = TorchAttention().forward(q, k, v, kv.clone(), meta)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("decode_lens, prefills, window", CASES)
def test_prefill_kernel_matches_and_never_reads_past_the_window(decode_lens, prefills, window, path):
    dtype = prefill_attention.DTYPES[path]
    q, k, v, kv, poisoned, meta = windowed_batch(decode_lens, prefills, window, head_dim=256, dtype=dtype)
    out = CpuPagedAttention(max_prefill_queries=0, prefill_kernel=path).forward(q, k, v, poisoned, meta)
    assert not out.isnan().any()
    ref = TorchAttention().forward(*(t.float() for t in (q, k, v, kv)), meta)
    assert_prefill_close(out, ref, path)
