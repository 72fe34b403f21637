"""This machine's limits, measured on the spot: matmul FLOP/s and memory read bandwidth.

A decode step at large batch is bounded by matmul throughput (about 2 FLOPs per weight
per token); at batch 1 it is bounded by reading every weight once per step. Both are
measured here, on the engine's device and in the same process as the step they judge,
so the ratio is fair.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.platforms.huge_pages import PLAIN, huge_page_buffer


@dataclass
class Roofline:
    dtype: str
    matmul_gflops: float  # best of a few [m, k] x [k, n] matmuls, GFLOP/s
    read_gb_per_s: float  # best of a few full reads of a tensor much larger than the caches
    device: str = "cpu"
    read_pages: str = ""  # on a CPU, the pages of that read: a share judged on 4 KB pages flatters


def _best_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    fn()  # warm-up: thread pool, allocator, oneDNN primitive cache, cuBLAS handle
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_gflops(dtype: torch.dtype, device: torch.device, m: int, k: int, n: int, repeats: int = 10) -> float:
    a, b = torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)
    seconds = _best_seconds(lambda: torch.mm(a, b), repeats, device)
    return 2 * m * k * n / seconds / 1e9


def read_gb_per_s(device: torch.device, size_bytes: int = 1 << 30, repeats: int = 5) -> tuple[float, str]:
    """The best rate of full reads of a tensor much larger than the caches, and on a CPU the
    pages it was read on. A CPU reads on plain pages and on the huge pages kvserve puts its
    weights on where the OS gives them (too few reserved pages left: transparent or plain), and
    the faster counts: reading on 2 MB pages can be 30% faster, and a step reading its
    weights there must be judged against that."""
    rates = [(_read_gb_per_s(torch.ones(size_bytes // 4, device=device), repeats, device), PLAIN)]
    if device.type != "cpu":
        return rates[0][0], ""
    buffer, pages = huge_page_buffer(size_bytes)
    rates.append((_read_gb_per_s(buffer[:size_bytes].view(torch.float32).fill_(1.0), repeats, device), pages))
    return max(rates)


def _read_gb_per_s(x: torch.Tensor, repeats: int, device: torch.device) -> float:
    return x.numel() * x.element_size() / _best_seconds(lambda: x.sum(), repeats, device) / 1e9


def measure(dtype: torch.dtype, device: torch.device) -> Roofline:
    # a GPU needs a far larger product than a CPU to reach its peak (launch cost, thousands of cores)
    m, k, n = (8192, 8192, 8192) if device.type == "cuda" else (512, 2048, 2048)
    rate, pages = read_gb_per_s(device)
    return Roofline(str(dtype).removeprefix("torch."), matmul_gflops(dtype, device, m, k, n), rate, device.type, pages)
