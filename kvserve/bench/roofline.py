"""This machine's limits, measured on the spot: matmul FLOP/s and memory read bandwidth.

A decode step at large batch is bounded by matmul throughput (about 2 FLOPs per weight
per token); at batch 1 it is bounded by reading every weight once per step. Both are
measured here, in the same process as the step they judge, so the ratio is fair.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class Roofline:
    dtype: str
    matmul_gflops: float  # best of a few [m, k] x [k, n] matmuls, GFLOP/s
    read_gb_per_s: float  # best of a few full reads of a tensor much larger than the caches


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: thread pool, allocator, oneDNN primitive cache
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(dtype: torch.dtype, m: int = 512, k: int = 2048, n: int = 2048, repeats: int = 10) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * m * k * n / seconds / 1e9


def read_gb_per_s(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    x = torch.ones(size_bytes // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: x.sum(), repeats)
    return size_bytes / seconds / 1e9


def measure(dtype: torch.dtype) -> Roofline:
    return Roofline(str(dtype).removeprefix("torch."), matmul_gflops(dtype), read_gb_per_s())
