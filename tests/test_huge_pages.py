"""The small-batch kernel's weights moved into one huge-page buffer: the same bits out, one
buffer for the whole model, each weight on a cache line, whatever pages the OS gives."""

from __future__ import annotations

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kernels.small_batch_linear import SmallBatchWeight
from kvserve.kernels.small_batch_linear import isa as small_batch_isa
from kvserve.layers.linear import PackedLinear
from kvserve.platforms.huge_pages import (
    ALIGN,
    HUGE_PAGE,
    PLAIN,
    RESERVED,
    TRANSPARENT,
    huge_page_buffer,
    move_to_huge_pages,
)

FP32_ISA = small_batch_isa(torch.float32)
PAGES = (RESERVED, TRANSPARENT, PLAIN)


def test_the_buffer_is_zeroed_aligned_and_whole_huge_pages() -> None:
    buffer, pages = huge_page_buffer(3 * HUGE_PAGE + 1)
    assert pages in PAGES
    assert buffer.dtype == torch.uint8 and buffer.numel() == 4 * HUGE_PAGE
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert not buffer.any()
    buffer[-1] = 7  # writable to its end
    assert buffer[-1].item() == 7


@pytest.mark.skipif(not FP32_ISA, reason="no fp32 small-batch kernel")
def test_moved_weights_give_the_same_bits_from_one_buffer() -> None:
    torch.manual_seed(0)
    weights = [
        SmallBatchWeight(torch.randn(n, k).bfloat16().float(), torch.randn(n) if bias else None, FP32_ISA)
        for n, k, bias in [(70, 33, True), (64, 64, False), (130, 7, True)]
    ]
    xs = [torch.randn(3, w.packed.shape[1]) for w in weights]
    before = [w(x) for w, x in zip(weights, xs, strict=True)]
    packed = [w.packed.clone() for w in weights]

    moved, pages = move_to_huge_pages(weights)

    assert pages in PAGES
    assert moved == sum(p.numel() * p.element_size() for p in packed)
    assert len({w.packed.untyped_storage().data_ptr() for w in weights}) == 1
    assert all(w.packed.data_ptr() % ALIGN == 0 for w in weights)
    for w, p, x, y in zip(weights, packed, xs, before, strict=True):
        assert torch.equal(w.packed, p)
        assert torch.equal(w(x), y)


@pytest.mark.skipif(not FP32_ISA, reason="no fp32 small-batch kernel")
def test_the_cpu_platform_moves_every_small_batch_weight_of_a_model(tiny_model_dir) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=16))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.small is not None for m in linears)
    assert len({m.small.packed.untyped_storage().data_ptr() for m in linears}) == 1
