"""CpuPagedAttention (compiled kernel) against TorchAttention on random paged batches.

Tolerances: float32 matches TorchAttention to 1e-5. For bfloat16 the kernel is compared
with TorchAttention run in float32 on the same (bf16-valued) inputs: the kernel computes
in fp32 and rounds once at the end, so it must agree to one bf16 rounding (rtol 2^-8,
atol 1e-3); TorchAttention in bf16 itself is only checked loosely (2e-2).
"""

from __future__ import annotations

import pytest
import torch

from kvserve.engine.model_runner import _decode_tensors, _prefill_seq
from kvserve.kernels import build, paged_attention, prefill_attention, small_batch_linear
from kvserve.kernels.paged_attention import KernelRows
from kvserve.layers.attention.backend import AttentionMetadata, TorchAttention
from kvserve.layers.attention.cpu import CpuPagedAttention, kernel_batch
from kvserve.platforms.cpu import CpuPlatform

BS = 16


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    reason = build.unavailable_reason()  # builds on first use (python -m kvserve.kernels.build)
    if reason is not None:
        pytest.skip(f"CPU paged-attention kernel unavailable: {reason}")


def make_batch(decode_lens, prefills, heads, kv_heads, head_dim, dtype, seed=0, block_size=BS, window=None):
    """Random q/k/v and a pool whose blocks are handed out in random order.

    decode_lens: context length of each decode (its new token is the last one);
    prefills: (cached prefix, new tokens) of each prefill chunk.
    """
    g = torch.Generator().manual_seed(seed)
    seqs = [(n - 1, 1) for n in decode_lens] + list(prefills)
    blocks_needed = [-(-(p + n) // block_size) for p, n in seqs]
    pool = torch.randperm(sum(blocks_needed) + 8, generator=g) + 1  # block 0 only ever padding
    kv = torch.randn(2, sum(blocks_needed) + 10, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables, slots, prefill_seqs, offset, start = [], [], [], 0, 0
    for (prefix, n), nb in zip(seqs, blocks_needed, strict=True):
        table = pool[offset : offset + nb]
        offset += nb
        pos = torch.arange(prefix, prefix + n)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        if len(tables) < len(decode_lens):
            tables.append(table.tolist())
        else:
            prefill_seqs.append(_prefill_seq(start, prefix, n, table, block_size, window))
        start += n
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=len(decode_lens),
        prefills=prefill_seqs,
        sliding_window=window,
        **_decode_tensors(tables, list(decode_lens)),
    )
    q, k, v = (torch.randn(start, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v, kv, meta


def run_both(backend, q, k, v, kv, meta, reference_dtype=None):
    """(backend output, TorchAttention output), each on its own copy of the cache."""
    ref_dtype = reference_dtype or q.dtype
    out = backend.forward(q, k, v, kv.clone(), meta)
    ref = TorchAttention().forward(*(t.to(ref_dtype) for t in (q, k, v, kv)), meta)
    return out, ref


def assert_bf16_close(out, ref):
    torch.testing.assert_close(out.float(), ref, rtol=2**-8, atol=1e-3)


DECODE_LENS = [1, 15, 16, 17, 64, 300, 1037]  # one token, block boundaries, long, past 1000


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128, 256])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])  # GQA ratio 1, 3, 4
def test_decode_float32(heads, kv_heads, head_dim):
    batch = make_batch(DECODE_LENS, [], heads, kv_heads, head_dim, torch.float32)
    out, ref = run_both(CpuPagedAttention(), *batch)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_decode_bfloat16(heads, kv_heads, head_dim):
    batch = make_batch(DECODE_LENS, [], heads, kv_heads, head_dim, torch.bfloat16, seed=1)
    out, ref32 = run_both(CpuPagedAttention(), *batch, reference_dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    assert_bf16_close(out, ref32)
    ref16 = TorchAttention().forward(*batch)
    torch.testing.assert_close(out, ref16, rtol=2e-2, atol=2e-2)


@pytest.fixture(params=[1, 2, 3, 4])
def num_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "decode_lens, prefills",
    [([1], []), ([64], []), ([65], []), ([300], []), ([1037], []), ([], [(300, 4)]), ([], [(0, 9)]), ([40, 700], [])],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_sequences_than_threads(decode_lens, prefills, dtype, num_threads):
    """Fewer work items than threads: each sequence's keys split into equal runs (cut at
    16-key blocks), one per thread, merged after; a sequence of one tile hands out its KV heads."""
    batch = make_batch(decode_lens, prefills, 9, 3, 64, dtype, seed=2)
    out, ref = run_both(CpuPagedAttention(max_prefill_queries=16), *batch, reference_dtype=torch.float32)
    if dtype == torch.bfloat16:
        assert_bf16_close(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_writes_the_new_kv_like_torch():
    q, k, v, kv, meta = make_batch([5, 40], [(0, 7), (20, 9)], 9, 3, 64, torch.float32)
    mine, theirs = kv.clone(), kv.clone()
    CpuPagedAttention().forward(q, k, v, mine, meta)
    TorchAttention().forward(q, k, v, theirs, meta)
    assert torch.equal(mine, theirs)


# decodes, then prefills: fresh short / fresh long / cached prefix short / cached prefix long
MIXED = ([3, 16, 200], [(0, 5), (0, 40), (30, 10), (50, 37), (1000, 3)])


@pytest.mark.parametrize("max_prefill_queries", [0, 16, 10**6])  # kernel for: decodes only / default / all
def test_mixed_batch_float32(max_prefill_queries):
    batch = make_batch(*MIXED, 9, 3, 64, torch.float32, seed=2)
    out, ref = run_both(CpuPagedAttention(max_prefill_queries), *batch)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("max_prefill_queries", [16, 10**6])
def test_mixed_batch_bfloat16(max_prefill_queries):
    batch = make_batch(*MIXED, 8, 2, 128, torch.bfloat16, seed=3)
    out, ref32 = run_both(CpuPagedAttention(max_prefill_queries), *batch, reference_dtype=torch.float32)
    meta = batch[4]
    kernel_rows = torch.zeros(out.shape[0], dtype=torch.bool)
    kernel_rows[: meta.num_decode_tokens] = True
    for s in meta.prefills:
        kernel_rows[s.query_start : s.query_start + s.query_len] = s.query_len <= max_prefill_queries
    # kernel rows: one bf16 rounding; long prefills run TorchAttention in bf16: its own error
    assert_bf16_close(out[kernel_rows], ref32[kernel_rows])
    torch.testing.assert_close(out.float(), ref32, rtol=2e-2, atol=2e-2)


def test_float16_decode():
    batch = make_batch([1, 17, 500], [], 9, 3, 64, torch.float16, seed=4)
    out, ref32 = run_both(CpuPagedAttention(), *batch, reference_dtype=torch.float32)
    torch.testing.assert_close(out.float(), ref32, rtol=2**-10, atol=1e-3)


def test_plan_is_built_once_per_step():
    backend = CpuPagedAttention()
    q, k, v, kv, meta = make_batch([9, 33], [(4, 6)], 9, 3, 64, torch.float32)
    backend.forward(q, k, v, kv, meta)
    plan = meta.backend_state
    backend.forward(q, k, v, kv, meta)  # the next layer: same meta, same plan
    assert meta.backend_state is plan


def test_bad_block_id_raises_instead_of_reading_out_of_bounds():
    q, k, v, kv, meta = make_batch([20], [], 9, 3, 64, torch.float32)
    meta.decode_block_tables[0, 1] = kv.shape[1] + 5
    meta.slot_mapping[:] = 0
    with pytest.raises(RuntimeError, match="out of range"):
        CpuPagedAttention().forward(q, k, v, kv, meta)


def test_unsupported_head_dim_falls_back():
    assert paged_attention.supports(64) and paged_attention.supports(16) and not paged_attention.supports(48)
    platform = CpuPlatform(torch.device("cpu"), torch.float32)
    assert isinstance(platform.attention_backend(48), TorchAttention)
    assert isinstance(platform.attention_backend(64), CpuPagedAttention)


# The prefill kernel on every path this CPU runs: fp32 with FMAs (built for any CPU; the engine
# takes it on AVX2 hosts), held to fp32 rounding; bf16 on AMX tiles where granted and with the
# AVX512-BF16 dot products wherever that ISA is (an AMX host included): P is rounded to bf16
# before P V, as SDPA's flash kernel does, so it is held to SDPA-in-bf16's bounds against the
# fp32 reference.
PREFILL_PATHS = ["f32", *small_batch_linear.bf16_paths()]
each_prefill_path = pytest.mark.parametrize("path", PREFILL_PATHS)
CHUNKS = [(0, 2), (0, 40), (30, 10), (50, 37), (1000, 3), (100, 365), (16, 16), (17, 64)]


def assert_prefill_close(out, ref32, path):
    if path == "f32":
        torch.testing.assert_close(out, ref32, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref32, rtol=1e-2, atol=1e-2)


@each_prefill_path
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_prefill_kernel(heads, kv_heads, head_dim, path):
    batch = make_batch([3, 200], CHUNKS, heads, kv_heads, head_dim, prefill_attention.DTYPES[path], seed=5)
    backend = CpuPagedAttention(max_prefill_queries=0, prefill_kernel=path)
    out, ref32 = run_both(backend, *batch, reference_dtype=torch.float32)
    plan = batch[-1].backend_state
    assert plan.chunks is not None and not plan.torch_prefills  # every chunk took the kernel
    assert_prefill_close(out, ref32, path)


@each_prefill_path
@pytest.mark.parametrize("chunk", [(500, 32), (0, 70), (37, 5), (300, 1)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2), (4, 4)])
def test_prefill_kernel_single_chunk(chunk, heads, kv_heads, path):
    """One chunk (a cache hit's turn): too few (sequence, KV head) pairs for the threads, so each
    pair's rows are split into several work items."""
    batch = make_batch([], [chunk], heads, kv_heads, 64, prefill_attention.DTYPES[path], seed=7)
    backend = CpuPagedAttention(max_prefill_queries=0, prefill_kernel=path)
    out, ref32 = run_both(backend, *batch, reference_dtype=torch.float32)
    assert_prefill_close(out, ref32, path)


@each_prefill_path
def test_prefill_kernel_without_sequences(path):
    """A call with no chunks does nothing (splitting rows over zero pairs divided by zero)."""
    cache = torch.zeros(2, 4, BS, 3, 64, dtype=prefill_attention.DTYPES[path])
    q = torch.zeros(0, 9, 64, dtype=cache.dtype)
    none = torch.zeros(0, dtype=torch.long)
    rows = KernelRows(none.view(0, 1), none, none, none.int())
    prefill_attention.prefill_attention(q.clone(), q, cache, rows, 0.125, 0, use_amx=path == "amx")


@each_prefill_path
def test_prefill_kernel_ignores_stale_slots(path):
    """Slots past a context may hold anything (NaN from a freed request): never read into the output."""
    q, k, v, kv, meta = make_batch([], [(5, 20), (40, 33)], 9, 3, 64, prefill_attention.DTYPES[path], seed=6)
    ref = TorchAttention().forward(q.float(), k.float(), v.float(), kv.float(), meta)
    written = torch.zeros(kv.shape[1] * BS, dtype=torch.bool)
    written[meta.slot_mapping] = True
    for s in meta.prefills:  # the cached prefixes too
        written[(s.block_table[:, None] * BS + torch.arange(BS)).flatten()[: s.context_len]] = True
    poisoned = kv.clone()
    poisoned.view(2, -1, *kv.shape[3:])[:, ~written] = float("nan")
    out = CpuPagedAttention(max_prefill_queries=0, prefill_kernel=path).forward(q, k, v, poisoned, meta)
    assert_prefill_close(out, ref, path)


def test_prefill_kernel_refuses_other_dtypes():
    q = torch.zeros(4, 9, 64, dtype=torch.float16)
    cache = torch.zeros(2, 4, BS, 3, 64, dtype=torch.float16)
    one = torch.tensor([4])
    rows = KernelRows(torch.zeros(1, 1, dtype=torch.long), torch.tensor([0]), one, one.int())
    with pytest.raises(RuntimeError, match="fp32 or bf16 only"):
        prefill_attention.prefill_attention(q.clone(), q, cache, rows, 0.125, 0, use_amx=False)


def test_chunks_split_between_kernels_by_path():
    """By default AMX takes every chunk; the dot products those past 4 queries (they won from ~4 on a
    Zen 5), the fp32 kernel those past 8 (from ~16 on AVX2 for fresh prompts, ~8 after a cached
    prefix), the paged kernel keeping the shorter ones; without a prefill kernel the paged kernel
    keeps chunks up to 16 and SDPA takes the rest. An explicit limit holds on every path."""
    *_, meta = make_batch([7], [(30, 4), (30, 5), (0, 16), (0, 17)], 9, 3, 64, torch.bfloat16)
    for path, paged, chunks in (
        ("amx", [1], [4, 5, 16, 17]),
        ("avx512_bf16", [1, 4], [5, 16, 17]),
        ("f32", [1, 4, 5], [16, 17]),
        ("", [1, 4, 5, 16], None),
    ):
        plan = kernel_batch(meta, None, path)
        assert plan.paged.query_lens.tolist() == paged
        assert (plan.chunks and plan.chunks.query_lens.tolist()) == chunks
        assert [s.query_len for s in plan.torch_prefills] == ([17] if not path else [])
    for path in ("amx", "avx512_bf16", "f32"):
        assert kernel_batch(meta, 16, path).chunks.query_lens.tolist() == [17]


@pytest.mark.parametrize("path, dtype", [("f32", torch.bfloat16), ("avx512_bf16", torch.float32)])
def test_prefill_kernel_only_for_its_dtype(path, dtype):
    """A chunk of another dtype than the path's goes where it would without a prefill kernel (SDPA)."""
    *_, meta = make_batch([], [(0, 40)], 9, 3, 64, dtype)
    plan = CpuPagedAttention(prefill_kernel=path).plan(meta, dtype, BS, dtype)
    assert plan.chunks is None and [s.query_len for s in plan.torch_prefills] == [40]


def test_fp32_prefill_kernel_where_dtype_auto_is_fp32():
    """The engine takes the fp32 kernel on AVX2 builds only: the hosts whose dtype "auto" is fp32."""
    isa = build.load().vector_isa()
    assert prefill_attention.isa(torch.float32) == ("f32" if isa == "avx2" else "")
    backend = CpuPlatform(torch.device("cpu"), torch.float32).attention_backend(64)
    assert backend.prefill_kernel == prefill_attention.isa(torch.float32)
