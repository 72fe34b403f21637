"""Engine configuration: the knobs of `LLM(...)` and `kvserve serve`, named as in vLLM.

Plain data, checked where it is built; no torch, so a router or a CLI can import it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def cache_root() -> Path:
    """Where kvserve keeps converted checkpoints and built kernels: $KVSERVE_CACHE_DIR or ~/.cache/kvserve."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def parse_memory(value: str | int) -> int:
    """'2GiB', '512MB', 1073741824 -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory must look like '2GiB' or '512MB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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
