"""Where a model runs: the device and dtype `auto` resolve to, and the platform that picks
each op's implementation there (`interface.Platform`, `cpu.CpuPlatform`)."""

from __future__ import annotations

import torch

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
    """The platform for an `EngineConfig`'s device and dtype ('auto' resolved here)."""
    resolved = resolve_device(device)
    kind = CpuPlatform if resolved.type == "cpu" else Platform
    return kind(resolved, resolve_dtype(dtype, resolved))
