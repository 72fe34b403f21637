"""Engine configuration: the knobs of `LLM(...)` and `kvserve serve`, named as in vLLM."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kvserve.model.loader import DEFAULT_MODEL

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: str | int) -> int:
    """'2GiB', '512MB', 1073741824 -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory must look like '2GiB' or '512MB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # bfloat16 where the hardware multiplies it natively, else float32
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | int = "2GiB"
    num_kv_blocks: int | None = None  # overrides kv_cache_memory (tests use tiny pools)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's context length
    prefill_first: bool = False  # SGLang's policy: new prompts' prefills get steps of their own
    enable_prefix_caching: bool = True
    prefix_cache: str = "radix"  # "radix" (RadixAttention tree) or "hash" (chained block hashes)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if parse_memory(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if self.prefix_cache not in ("radix", "hash"):
            raise ValueError(f"prefix_cache must be 'radix' or 'hash', got {self.prefix_cache!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
