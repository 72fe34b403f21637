"""The fused CPU layer kernels agree with the PyTorch reference (`TorchLayerOps`)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import build
from kvserve.kernels.layer_ops import CpuLayerOps
from kvserve.layers.layer_ops import TorchLayerOps

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel() -> CpuLayerOps:
    reason = build.unavailable_reason()
    if reason is not None:
        pytest.skip(f"CPU kernels unavailable: {reason}")
    return CpuLayerOps()


def assert_close_to_last_bit(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16: within one unit in the last place and mostly identical; fp32: within a few units
    (sum order, rsqrt vs 1/sqrt, exp, FMA differ, and the bf16 rounding hides them)."""
    eps = torch.finfo(expected.dtype).eps
    ulps = 2 if expected.dtype == torch.bfloat16 else 16  # eps is half an ulp at the top of a binade
    diff = (actual.float() - expected.float()).abs()
    bound = ulps * eps * expected.float().abs() + eps * 1e-3
    assert (diff <= bound).all(), f"max diff {diff.max().item()}"
    if expected.dtype == torch.bfloat16:
        assert (diff == 0).float().mean() > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_with_and_without_residual(kernel, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 576, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(576, generator=g).to(dtype)
    assert_close_to_last_bit(kernel.rms_norm(x, w, 1e-5)[0], TorchLayerOps.rms_norm(x, w, 1e-5)[0])
    expected, expected_res = TorchLayerOps.rms_norm(x, w, 1e-5, res.clone())
    out, new_res = kernel.rms_norm(x, w, 1e-5, res)
    assert torch.equal(new_res, expected_res) and new_res is res  # residual += x, in place
    assert_close_to_last_bit(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(kernel, dtype):
    x = (torch.randn(33, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    assert_close_to_last_bit(kernel.silu_and_mul(x), TorchLayerOps.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views(kernel, dtype):
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(40, (9 + 3 + 3) * 64, generator=g).to(dtype)  # q, k are views into it, as in the model
    cos_sin = torch.randn(40, 64, generator=g).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(-1, 9, 64), k.view(-1, 3, 64)
    expected_q, expected_k = TorchLayerOps.rotary(q.clone(), k.clone(), cos_sin)
    out_q, out_k = kernel.rotary(q, k, cos_sin)
    assert out_q.data_ptr() == q.data_ptr()  # in place, in the qkv buffer
    if dtype == torch.bfloat16:  # every product and sum rounded where PyTorch rounds: same bits
        assert torch.equal(out_q, expected_q) and torch.equal(out_k, expected_k)
    else:  # fp32: PyTorch's vector code may fuse a multiply-add (error relative to the inputs)
        torch.testing.assert_close(out_q, expected_q, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(out_k, expected_k, rtol=1e-6, atol=1e-5)


def test_bad_shapes_raise(kernel):
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        kernel.ops.silu_and_mul(torch.empty(2, 3), torch.empty(2, 5))
    with pytest.raises(RuntimeError, match="dtype"):
        kernel.rms_norm(torch.ones(2, 4, dtype=torch.float16), torch.ones(4, dtype=torch.float16), 1e-5)
