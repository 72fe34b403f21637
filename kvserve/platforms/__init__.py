"""Where a model runs: the device and dtype `auto` resolve to, and the platform that picks
each op's implementation there (`interface.Platform`, `cpu.CpuPlatform`)."""

from __future__ import annotations

import torch

from kvserve.kernels.small_batch_linear import isa as small_batch_isa
from kvserve.platforms.cpu import CpuPlatform
from kvserve.platforms.interface import Platform


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run at least as fast as fp32 ones."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA device is present")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        native = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"dtype must be one of auto, {', '.join(choices)}; got {dtype!r}")
    return choices[dtype]


def get_platform(device: str, dtype: str) -> Platform:
    """The platform for an `EngineConfig`'s device and dtype ('auto' resolved here).

    'auto' on a CPU without bf16 arithmetic computes in fp32 on weights rounded to bf16, where
    the small-batch kernel reads them as bf16 (its AVX2 path): a decode step is bound by
    reading the weights, so it reads half, and the weights hold what bf16 hosts run with.
    'float32' keeps the weights as loaded."""
    resolved = resolve_device(device)
    if resolved.type != "cpu":
        return Platform(resolved, resolve_dtype(dtype, resolved))
    compute = resolve_dtype(dtype, resolved)
    bf16_weights = dtype == "auto" and compute == torch.float32 and small_batch_isa(torch.float32) == "avx2"
    return CpuPlatform(resolved, compute, torch.bfloat16 if bf16_weights else None)
