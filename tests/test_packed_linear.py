"""Pre-packed linears: oneDNN's path and kvserve's small-batch kernel (bf16 on AMX or
AVX512-BF16, fp32 on AVX2) give F.linear's result to bf16 rounding (fp32: to its
summation order), for every row count and odd sizes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels.small_batch_linear import SMALL_BATCH_MAX_ROWS, SmallBatchWeight, bf16_paths
from kvserve.kernels.small_batch_linear import isa as small_batch_isa
from kvserve.layers.linear import PackedLinear, can_pack

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not can_pack(torch.float32, CPU), reason="no oneDNN")

# an AMX machine also runs the AVX512-BF16 path; elsewhere the bf16 tests have nothing to run
HAS_BF16 = can_pack(torch.bfloat16, CPU)
ISAS = bf16_paths() if HAS_BF16 else []
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="no oneDNN bf16")
FP32_ISA = small_batch_isa(torch.float32)  # "avx2" where the fp32 path is compiled in
DTYPES_AND_ISAS = [(torch.bfloat16, isa) for isa in ISAS] + ([(torch.float32, FP32_ISA)] if FP32_ISA else [])


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Exact (fp64) sums of the inputs, rounded once to their dtype, as the kernels round."""
    return F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)


def assert_rounding_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # different summation orders: at most a rounding step or two of bf16 apart; fp32 sums
    # of up to 128 products of N(0, 1) values differ by a few ulps of their size (~10)
    tol = 2**-6 if out.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("dtype", "isa"), DTYPES_AND_ISAS)
# 1-13: every remainder of the dot-product path's 6-row blocks, one block and two; 16-40:
# AMX's one and two 16-row blocks; 64 and 131: several passes of each
@pytest.mark.parametrize("rows", [*range(1, 14), 16, 17, 25, 32, 40, 64, 131])
@pytest.mark.parametrize(("n", "k", "bias"), [(200, 96, True), (64, 64, False), (70, 128, True), (9, 5, True)])
def test_small_batch_kernel_matches_f_linear(dtype, isa: str, rows: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    if not SmallBatchWeight.fits(w, isa):
        pytest.skip(f"K={k} does not fit {isa}")
    out = SmallBatchWeight(w, b, isa)(x)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert_rounding_close(out, reference(x, w, b))


@pytest.mark.parametrize(("dtype", "isa"), [*DTYPES_AND_ISAS, (torch.bfloat16, ""), (torch.float32, "")])
def test_packed_linear_uses_the_kernel_up_to_max_rows_then_onednn(dtype, isa: str) -> None:
    if dtype == torch.bfloat16 and not HAS_BF16:
        pytest.skip("no oneDNN bf16")
    w, b = torch.randn(130, 64).to(dtype), torch.randn(130).to(dtype)
    layer = PackedLinear(w, b, isa)
    assert (layer.small is not None) == bool(isa)
    limit = SMALL_BATCH_MAX_ROWS.get(isa, 0)
    for rows in sorted({1, limit, limit + 1, 100} - {0}):
        x = torch.randn(rows, 64).to(dtype)
        assert_rounding_close(layer(x), reference(x, w, b))


@needs_bf16
def test_shapes_the_kernel_cannot_take_fall_back_to_onednn() -> None:
    w = torch.randn(32, 48).to(torch.bfloat16)  # K = 48: not a multiple of AMX's 32
    assert not SmallBatchWeight.fits(w, "amx") and SmallBatchWeight.fits(w, "avx512_bf16")
    assert not SmallBatchWeight.fits(torch.randn(32, 47).to(torch.bfloat16), "avx512_bf16")
    assert PackedLinear(w, None, "amx").small is None


def test_each_kernel_path_takes_only_its_dtype() -> None:
    w = torch.randn(32, 47)
    assert SmallBatchWeight.fits(w, "avx2") and SmallBatchWeight.fits(w.to(torch.bfloat16), "avx2")
    assert not SmallBatchWeight.fits(w.to(torch.float16), "avx2")
    assert not SmallBatchWeight.fits(torch.randn(32, 48), "avx512_bf16")
    assert PackedLinear(w, None, "avx512_bf16").small is None


@pytest.mark.skipif(FP32_ISA != "avx2", reason="no AVX2 fp32 path")
@pytest.mark.parametrize("rows", [*range(1, 14), 17, 64])
@pytest.mark.parametrize(("n", "k", "bias"), [(200, 96, True), (70, 128, False), (9, 5, True)])
def test_avx2_path_reads_bf16_weights_to_the_same_bits(rows: int, n: int, k: int, bias: bool) -> None:
    """The same loop on the weight stored as bf16 (widened in registers): fp32 x, the same sums."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    narrow = SmallBatchWeight(w, b, "avx2")
    assert narrow.packed.dtype == torch.bfloat16
    assert torch.equal(narrow(x), SmallBatchWeight(w.float(), b, "avx2")(x))
    assert_rounding_close(narrow(x), reference(x, w.float(), b))


@pytest.mark.skipif(FP32_ISA != "avx2", reason="no AVX2 fp32 path")
def test_packed_linear_keeps_an_fp32_weight_of_bf16_values_as_bf16_for_the_kernel() -> None:
    w = torch.randn(130, 64)
    assert PackedLinear(w, None).small.packed.dtype == torch.float32
    layer = PackedLinear(w.bfloat16().float(), None)
    assert layer.small.packed.dtype == torch.bfloat16
    x = torch.randn(3, 64)
    assert_rounding_close(layer(x), reference(x, w.bfloat16().float(), None))


# (x's dtype, the weight's, the kernel path): the AVX2 path also reads weights of bf16 values as bf16
ARGMAX_CASES = [(torch.bfloat16, torch.bfloat16, isa) for isa in ISAS] + (
    [(torch.float32, torch.float32, FP32_ISA), (torch.float32, torch.bfloat16, FP32_ISA)] if FP32_ISA else []
)


@pytest.mark.parametrize(("dtype", "w_dtype", "isa"), ARGMAX_CASES)
@pytest.mark.parametrize("rows", [1, 4, 5, 6, 7, 13, 17, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(200, 96), (70, 128), (1000, 64)])
def test_fused_argmax_is_the_argmax_of_the_kernels_own_logits(dtype, w_dtype, isa: str, rows: int, n: int, k: int):
    """Bit for bit torch.max over the logits the kernel writes (bf16 ones as stored); the
    padding columns (zero logits) never win, even when every real logit is negative."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = (torch.randn(n, k, generator=g) - 4).to(w_dtype)
    x = torch.rand(rows, k, generator=g).to(dtype)
    head = SmallBatchWeight(w, None, isa)
    logits = head(x).float()
    assert (logits < 0).all()
    assert torch.equal(head.argmax(x), logits.max(dim=-1).indices)


@pytest.mark.parametrize(("dtype", "w_dtype", "isa"), ARGMAX_CASES)
@pytest.mark.parametrize("rows", [3, 20])
def test_fused_argmax_skips_each_rows_banned_columns(dtype, w_dtype, isa: str, rows: int) -> None:
    """As torch.max over the logits with the banned columns set to -inf (min_tokens)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 64, generator=g).to(w_dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    head = SmallBatchWeight(w, None, isa)
    logits = head(x).float()
    top2 = logits.topk(2, dim=-1).indices
    # even rows ban their favourite and their runner-up, odd rows nothing; ids past the vocab are ignored
    banned = torch.full((rows, 3), -1, dtype=torch.long)
    banned[::2, :2] = top2[::2]
    banned[::2, 2] = 1000
    masked = logits.clone()
    masked[torch.arange(rows)[::2].unsqueeze(1), top2[::2]] = float("-inf")
    got = head.argmax(x, banned)
    assert torch.equal(got, masked.max(dim=-1).indices)
    assert (got[::2] != top2[::2, 0]).all() and torch.equal(got[1::2], top2[1::2, 0])


@pytest.mark.parametrize(("dtype", "w_dtype", "isa"), ARGMAX_CASES)
def test_fused_argmax_names_the_first_of_equal_maxima(dtype, w_dtype, isa: str) -> None:
    w = torch.full((130, 32), -1.0)
    w[[9, 70, 129], 0] = 2.0  # columns in different tiles and threads' ranges tie
    x = torch.zeros(6, 32)
    x[:, 0] = 1.0
    head = SmallBatchWeight(w.to(w_dtype), None, isa)
    assert head.argmax(x.to(dtype)).tolist() == [9] * 6


@pytest.mark.skipif(not FP32_ISA, reason="no fp32 small-batch kernel")
def test_fp32_packed_linear_fuses_argmax_up_to_max_rows() -> None:
    w = torch.randn(130, 64)
    layer = PackedLinear(w, None, FP32_ISA)
    x = torch.randn(3, 64)
    assert torch.equal(layer.argmax(x), layer(x).max(dim=-1).indices)
    assert layer.argmax(torch.randn(SMALL_BATCH_MAX_ROWS[FP32_ISA] + 1, 64)) is None  # the caller takes the logits


@needs_bf16
def test_packed_linear_fuses_argmax_only_where_its_kernel_runs() -> None:
    w = torch.randn(130, 64).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert PackedLinear(w, None, "").argmax(x) is None  # no kernel: the caller takes the logits
    assert PackedLinear(w, torch.zeros(130).to(torch.bfloat16), small_batch_isa()).argmax(x) is None  # a bias
    if ISAS:
        layer = PackedLinear(w, None, ISAS[0])
        assert torch.equal(layer.argmax(x), layer(x).float().max(dim=-1).indices)
        assert layer.argmax(torch.randn(SMALL_BATCH_MAX_ROWS[ISAS[0]] + 1, 64).to(torch.bfloat16)) is None


@pytest.mark.skipif(small_batch_isa() != "amx", reason="no AMX to turn off")
def test_kvserve_disable_amx_keeps_every_kernel_off_amx() -> None:
    """Read once per process, hence a subprocess: the small-batch kernel takes its dot
    products (and still matches F.linear), and prefill attention is offered its dot products."""
    code = (
        "import torch\n"
        "from kvserve.kernels import prefill_attention, small_batch_linear as s\n"
        "torch.manual_seed(0)\n"  # unseeded, 2% of draws had an output above 32, where bf16's rounding alone passes 0.1
        "w, x = torch.randn(70, 64).bfloat16(), torch.randn(9, 64).bfloat16()\n"
        "err = (s.SmallBatchWeight(w, None, s.isa())(x).float() - (x.double() @ w.double().T).float()).abs().max()\n"
        "print(s.isa(), prefill_attention.isa(), bool(err < 0.1))\n"
    )
    env = {**os.environ, "KVSERVE_DISABLE_AMX": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["avx512_bf16", "avx512_bf16", "True"]
