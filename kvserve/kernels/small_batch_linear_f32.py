"""`csrc/small_batch_linear_f32.cpp`: `small_batch_linear`'s fp32 path (AVX2 and FMA), which
the op takes for fp32 weights; weights are packed as `small_batch_linear.SmallBatchWeight`
packs them (one K value per lane)."""

from __future__ import annotations

from kvserve.kernels.build import available, load


def isa() -> str:
    """'avx2' where the fp32 path is compiled in, else ''."""
    return load().small_batch_linear_f32_isa() if available() else ""
