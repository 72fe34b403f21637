"""Pre-packed bf16 linears: oneDNN's path and kvserve's small-batch kernel (AMX or
AVX512-BF16) give F.linear's result to bf16 rounding, for every row count and odd sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model.packed_linear import SMALL_BATCH_MAX_ROWS, PackedLinear, SmallBatchWeight, can_pack, small_batch_isa

pytestmark = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bf16")

# an AMX machine also runs the AVX512-BF16 path; elsewhere these tests have nothing to run
ISAS = {"amx": ["amx", "avx512_bf16"], "avx512_bf16": ["avx512_bf16"]}.get(small_batch_isa(), [])


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 sums of the bf16 inputs, rounded once to bf16, as both kernels do."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)


def assert_bf16_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # different summation orders: at most a rounding step or two of bf16 apart
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 25, 32, 40, 64])
@pytest.mark.parametrize(("n", "k", "bias"), [(200, 96, True), (64, 64, False), (70, 128, True)])
def test_small_batch_kernel_matches_f_linear(isa: str, rows: int, n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    out = SmallBatchWeight(w, b, isa)(x)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert_bf16_close(out, reference(x, w, b))


@pytest.mark.parametrize("isa", [*ISAS, ""])
def test_packed_linear_uses_the_kernel_up_to_max_rows_then_onednn(isa: str) -> None:
    w, b = torch.randn(130, 64).to(torch.bfloat16), torch.randn(130).to(torch.bfloat16)
    layer = PackedLinear(w, b, isa)
    assert (layer.small is not None) == bool(isa)
    limit = SMALL_BATCH_MAX_ROWS.get(isa, 0)
    for rows in sorted({1, limit, limit + 1, 100} - {0}):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert_bf16_close(layer(x), reference(x, w, b))


def test_shapes_the_kernel_cannot_take_fall_back_to_onednn() -> None:
    w = torch.randn(32, 48).to(torch.bfloat16)  # K = 48: not a multiple of AMX's 32
    assert not SmallBatchWeight.fits(w, "amx") and SmallBatchWeight.fits(w, "avx512_bf16")
    assert not SmallBatchWeight.fits(torch.randn(32, 47).to(torch.bfloat16), "avx512_bf16")
    assert not SmallBatchWeight.fits(torch.randn(32, 48), "avx512_bf16")  # fp32: oneDNN alone
    assert PackedLinear(w, None, "amx").small is None


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 4, 5, 17, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(200, 96), (70, 128), (1000, 64)])
def test_fused_argmax_is_the_argmax_of_the_kernels_own_logits(isa: str, rows: int, n: int, k: int) -> None:
    """Bit for bit torch.max over the bf16 logits the kernel writes; the padding columns
    (zero logits) never win, even when every real logit is negative."""
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = (torch.randn(n, k, generator=g) - 4).to(torch.bfloat16)
    x = torch.rand(rows, k, generator=g).to(torch.bfloat16)
    head = SmallBatchWeight(w, None, isa)
    logits = head(x).float()
    assert (logits < 0).all()
    assert torch.equal(head.argmax(x), logits.max(dim=-1).indices)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [3, 20])
def test_fused_argmax_skips_each_rows_banned_columns(isa: str, rows: int) -> None:
    """As torch.max over the logits with the banned columns set to -inf (min_tokens)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
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


@pytest.mark.parametrize("isa", ISAS)
def test_fused_argmax_names_the_first_of_equal_maxima(isa: str) -> None:
    w = torch.full((130, 32), -1.0)
    w[[9, 70, 129], 0] = 2.0  # columns in different tiles and threads' ranges tie
    x = torch.zeros(6, 32)
    x[:, 0] = 1.0
    head = SmallBatchWeight(w.to(torch.bfloat16), None, isa)
    assert head.argmax(x.to(torch.bfloat16)).tolist() == [9] * 6


def test_packed_linear_fuses_argmax_only_where_its_kernel_runs() -> None:
    w = torch.randn(130, 64).to(torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert PackedLinear(w, None, "").argmax(x) is None  # no kernel: the caller takes the logits
    assert PackedLinear(w, torch.zeros(130).to(torch.bfloat16), small_batch_isa()).argmax(x) is None  # a bias
    if ISAS:
        layer = PackedLinear(w, None, ISAS[0])
        assert torch.equal(layer.argmax(x), layer(x).float().max(dim=-1).indices)
        assert layer.argmax(torch.randn(SMALL_BATCH_MAX_ROWS[ISAS[0]] + 1, 64).to(torch.bfloat16)) is None
