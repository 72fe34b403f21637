"""The kernels on K/V stored in another form than the compute dtype: bf16 under fp32, and int8
rows (`layers/attention/kv_quant.py`) under fp32 and bf16; the stored-as-computed pools too.

Each case runs CpuPagedAttention on a pool in the stored form and TorchAttention in fp32 on the
values the kernels see: each stored value widened to the compute dtype, int8 dequantized in fp32
(the paged kernel's factored form, scale * (q . codes) + minimum * sum(q), computes with exactly
those values; the prefill kernels round them to bf16 under bf16 compute, within their bound). So
the only difference is the kernels' own arithmetic: fp32 compute within 1e-5, bf16 within one
bf16 rounding (the paged kernel) or the prefill kernels' bounds (P rounded to bf16). What the
kernels write into the pool equals what `quantize_kv` (or `.to(bfloat16)`) gives, byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import PREFILL_PATHS, assert_bf16_close, assert_prefill_close, make_batch

from kvserve.kernels import build, prefill_attention
from kvserve.kernels.paged_attention import KernelRows, paged_attention
from kvserve.kernels.write_kv import write_kv
from kvserve.layers.attention.backend import TorchAttention
from kvserve.layers.attention.cpu import CpuPagedAttention
from kvserve.layers.attention.kv_quant import dequantize_kv, quantize_kv, stored_head_dim
from kvserve.platforms.cpu import CpuPlatform

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.uint8}
# (compute dtype, KV dtype) pairs the kernels read
PAIRS = [
    (torch.float32, "float32"),
    (torch.float32, "bfloat16"),
    (torch.float32, "int8"),
    (torch.bfloat16, "bfloat16"),
    (torch.bfloat16, "int8"),
]
each_pair = pytest.mark.parametrize("dtype, kv_name", PAIRS, ids=[f"{d}-{k}".replace("torch.", "") for d, k in PAIRS])


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    reason = build.unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU kernels unavailable: {reason}")


def store(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    return quantize_kv(x) if kv_dtype == torch.uint8 else x.to(kv_dtype)


def seen(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What compute in `dtype` reads of stored K/V, in fp32 (int8: dequantized in fp32)."""
    return dequantize_kv(stored) if stored.dtype == torch.uint8 else stored.to(dtype).float()


def make_case(decode_lens, prefills, heads, kv_heads, head_dim, block_size, dtype, kv_dtype, window=None, seed=0):
    """Random q/k/v (in `dtype`) and a pool stored as `kv_dtype` with blocks handed out at random."""
    q, k, v, pool, meta = make_batch(decode_lens, prefills, heads, kv_heads, head_dim, dtype, seed, block_size, window)
    return q, k, v, store(pool, kv_dtype), meta


def run_case(backend, q, k, v, stored, meta):
    """(kernel output, fp32 reference on the values seen, kernel's pool after its write, the expected pool)."""
    mine = stored.clone()
    out = backend.forward(q, k, v, mine, meta)
    expected = stored.clone()
    heads, dim = stored.shape[-2:]
    for side, x in ((0, k), (1, v)):
        expected[side].view(-1, heads, dim)[meta.slot_mapping] = store(x, stored.dtype)
    ks, vs = seen(store(k, stored.dtype), q.dtype), seen(store(v, stored.dtype), q.dtype)
    ref = TorchAttention().forward(q.float(), ks, vs, seen(expected, q.dtype), meta)
    return out, ref, mine, expected


def assert_kernel_close(out, ref, dtype, prefill_path=""):
    if prefill_path:
        assert_prefill_close(out, ref, prefill_path)
    elif dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_close(out, ref)


DECODE_LENS = [1, 7, 15, 16, 17, 64, 300, 1037]


@each_pair
@pytest.mark.parametrize("head_dim", [64, 256])  # SmolLM2's, Gemma 3's
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_decode(dtype, kv_name, head_dim, heads, kv_heads, block_size):
    case = make_case(DECODE_LENS, [], heads, kv_heads, head_dim, block_size, dtype, KV_DTYPES[kv_name], seed=1)
    out, ref, mine, expected = run_case(CpuPagedAttention(), *case)
    assert torch.equal(mine, expected)
    assert_kernel_close(out, ref, dtype)


# decodes, then chunks: fresh short / fresh long / after a cached prefix / tokens 1..16 of a block
MIXED = ([3, 16, 200], [(0, 5), (0, 40), (30, 10), (50, 37), (1000, 3), (16, 1), (17, 15), (33, 16)])


@each_pair
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (8, 2)])
def test_mixed_batch_on_the_paged_kernel(dtype, kv_name, heads, kv_heads):
    """Every chunk on the paged kernel (no prefill kernel), decodes beside them."""
    case = make_case(*MIXED, heads, kv_heads, 64, 16, dtype, KV_DTYPES[kv_name], seed=2)
    out, ref, mine, expected = run_case(CpuPagedAttention(max_prefill_queries=10**6), *case)
    assert torch.equal(mine, expected)
    assert_kernel_close(out, ref, dtype)


@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("kv_name", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_prefill_kernel(path, kv_name, head_dim, heads, kv_heads):
    """The prefill kernel on each path this CPU runs (AMX: an int8 cache as bf16 tiles) takes every chunk."""
    dtype = prefill_attention.DTYPES[path]
    if (dtype, kv_name) not in PAIRS:
        pytest.skip(f"{kv_name} K/V are not read under {dtype}")
    case = make_case(*MIXED, heads, kv_heads, head_dim, 16, dtype, KV_DTYPES[kv_name], seed=3)
    backend = CpuPagedAttention(max_prefill_queries=0, prefill_kernel=path)
    out, ref, mine, expected = run_case(backend, *case)
    plan = case[-1].backend_state
    assert plan.chunks is not None and not plan.torch_prefills
    assert torch.equal(mine, expected)
    decodes = case[-1].num_decode_tokens
    assert_kernel_close(out[:decodes], ref[:decodes], dtype)
    assert_kernel_close(out[decodes:], ref[decodes:], dtype, path)


@each_pair
@pytest.mark.parametrize("window", [1, 16, 50])
def test_sliding_window(dtype, kv_name, window):
    """Gemma 3's local layers: the paged kernel (decodes and chunks) and the prefill kernel where it runs."""
    kv_dtype = KV_DTYPES[kv_name]
    paths = [""] + [p for p in PREFILL_PATHS if prefill_attention.DTYPES[p] == dtype]
    for path in paths:
        case = make_case(*MIXED, 8, 2, 256, 16, dtype, kv_dtype, window=window, seed=4)
        backend = CpuPagedAttention(max_prefill_queries=0 if path else 10**6, prefill_kernel=path)
        out, ref, mine, expected = run_case(backend, *case)
        assert torch.equal(mine, expected)
        decodes = case[-1].num_decode_tokens
        assert_kernel_close(out[:decodes], ref[:decodes], dtype)
        assert_kernel_close(out[decodes:], ref[decodes:], dtype, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 80, 256])
def test_quantized_write_is_quantize_kv_bit_for_bit(dtype, head_dim):
    """Rows with ties, constant rows, one outlier, tiny and huge spans: the codes, scales and minima."""
    g = torch.Generator().manual_seed(5)
    tokens, heads = 64, 3
    k = torch.randn(tokens, heads, head_dim, generator=g) * torch.logspace(-6, 6, tokens).view(-1, 1, 1)
    k[0] = 1.5  # constant rows: span 0
    k[1, :, 0] = 1000.0  # an outlier
    k[2] = torch.arange(head_dim).float() / 2  # codes at .5 (ties to even)
    k, v = k.to(dtype), (-k).to(dtype)
    cache = torch.zeros(2, tokens // 4 + 1, 4, heads, stored_head_dim(head_dim), dtype=torch.uint8)
    slots = torch.randperm(cache.shape[1] * 4, generator=g)[:tokens]
    write_kv(k, v, cache, slots)
    for side, x in ((0, k), (1, v)):
        assert torch.equal(cache[side].view(-1, heads, stored_head_dim(head_dim))[slots], quantize_kv(x))


def test_bf16_write_rounds_to_nearest_even():
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(40, 2, 64, generator=g) for _ in range(2))
    cache = torch.zeros(2, 5, 16, 2, 64, dtype=torch.bfloat16)
    slots = torch.randperm(80, generator=g)[:40]
    write_kv(k, v, cache, slots)
    assert torch.equal(cache[0].view(-1, 2, 64)[slots], k.bfloat16())
    assert torch.equal(cache[1].view(-1, 2, 64)[slots], v.bfloat16())


def test_kernels_refuse_what_they_cannot_read():
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 2, 16, 4, 64)  # fp32 K/V under bf16 compute
    one = torch.tensor([1])
    rows = KernelRows(one.view(1, 1), one - 1, one, one.int())
    with pytest.raises(RuntimeError, match="caches must be of q's dtype"):
        paged_attention(q.clone(), q, cache, rows, 0.125)
    with pytest.raises(RuntimeError, match="cannot store"):
        write_kv(q.float()[:, :2], q.float()[:, :2], cache.half(), one - 1)


READABLE = {torch.float32: [torch.float32, torch.bfloat16, torch.uint8], torch.bfloat16: [torch.bfloat16, torch.uint8]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_platform_reads_stored_forms_on_the_kernels(dtype):
    platform = CpuPlatform(torch.device("cpu"), dtype)
    for kv_dtype in READABLE[dtype]:
        platform.kv_dtype = kv_dtype
        assert platform.reads_kv(kv_dtype)
        assert isinstance(platform.attention_backend(64), CpuPagedAttention)
