"""Where a model runs: the device and dtype `auto` resolve to, and the platform that picks
each op's implementation there (`interface.Platform`, `cpu.CpuPlatform`)."""

from __future__ import annotations

import torch

from kvserve.kernels.small_batch_linear import isa as small_batch_isa
from kvserve.logger import logger
from kvserve.platforms.cpu import CpuPlatform
from kvserve.platforms.interface import Platform

# the stored dtype of each `--kv-cache-dtype` but auto; int8's pool is uint8 (codes, scale, minimum)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.uint8}


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


def get_platform(device: str, dtype: str, kv_cache_dtype: str = "auto") -> Platform:
    """The platform for an `EngineConfig`'s device, dtype and KV cache dtype ('auto' resolved here).

    'auto' on a CPU without bf16 arithmetic computes in fp32 on weights rounded to bf16, where
    the small-batch kernel reads them as bf16 (its AVX2 path): a decode step is bound by
    reading the weights, so it reads half, and the weights hold what bf16 hosts run with.
    'float32' keeps the weights as loaded."""
    resolved = resolve_device(device)
    compute = resolve_dtype(dtype, resolved)
    if resolved.type != "cpu":
        platform = Platform(resolved, compute)
    else:
        bf16_weights = dtype == "auto" and compute == torch.float32 and small_batch_isa(torch.float32) == "avx2"
        platform = CpuPlatform(resolved, compute, torch.bfloat16 if bf16_weights else None)
    platform.kv_dtype = resolve_kv_dtype(kv_cache_dtype, dtype, platform)
    if not platform.reads_kv(platform.kv_dtype):
        logger.info(
            "KV cache dtype %s under %s compute: the attention kernels cannot read it, so attention runs on "
            "the PyTorch path (it casts or dequantizes K/V as it reads them), without the C++ layer loop",
            kv_dtype_name(platform.kv_dtype),
            compute,
        )
    return platform


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str, platform: Platform) -> torch.dtype:
    """'auto': float32 for a reference run (dtype 'float32'); else bfloat16 where the platform's
    fastest attention path reads it under the compute dtype (half the bytes per token), else
    the compute dtype (an AVX2 CPU computing in fp32 on the kernels). 'int8' is stored as
    uint8 rows of codes, scale and minimum (layers/attention/kv_quant.py)."""
    if kv_cache_dtype == "auto":
        if dtype == "float32" or platform.dtype == torch.float16:
            return platform.dtype
        return torch.bfloat16 if platform.reads_kv(torch.bfloat16) else platform.dtype
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(KV_DTYPES)}; got {kv_cache_dtype!r}")
    return KV_DTYPES[kv_cache_dtype]


def kv_dtype_name(kv_dtype: torch.dtype) -> str:
    """The name `--kv-cache-dtype` gives a pool's dtype: 'int8' for the uint8 pool of quantized rows."""
    return "int8" if kv_dtype == torch.uint8 else str(kv_dtype).removeprefix("torch.")
