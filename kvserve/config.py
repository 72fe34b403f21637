"""Engine configuration: the knobs of `LLM(...)` and `kvserve serve`, named as in vLLM.

Plain data, checked where it is built; no torch, so a router or a CLI can import it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"
ROLES = ("both", "prefill", "decode")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")  # int8: layers/attention/kv_quant.py
KV_REMOTE_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def cache_root() -> Path:
    """Where kvserve keeps converted checkpoints and built kernels: $KVSERVE_CACHE_DIR or ~/.cache/kvserve."""
    return Path(os.environ.get("KVSERVE_CACHE_DIR", Path.home() / ".cache" / "kvserve"))


def parse_memory(value: str | int, name: str = "kv_cache_memory") -> int:
    """'2GiB', '512MB', 1073741824 -> bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} must look like '2GiB' or '512MB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # bfloat16 where the hardware multiplies it natively, else float32 on bf16-rounded weights
    # how K/V are stored; auto: bfloat16 wherever the attention kernels read it under the compute
    # dtype, else the compute dtype, and float32 under --dtype float32 (a reference run); int8:
    # asymmetric 8-bit per (token, KV head) with its scale and minimum, never chosen by auto
    kv_cache_dtype: str = "auto"
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
    # sliding-window models (Gemma 3): keep every layer's whole history in one block table, as
    # if each layer were full, instead of one table per layer kind with window blocks released
    # as they pass (vLLM's name; a baseline for `kvserve bench window`)
    disable_hybrid_kv_cache_manager: bool = False
    # KV tiers below the device pool (kv_cache/tiers); 0 turns one off
    kv_host_memory: str | int | None = None  # default: off on a CPU (the pool is host RAM), 4GiB on an accelerator
    kv_disk_dir: str | None = None  # default: <cache root>/kv
    kv_disk_size: str | int | None = None  # default: $KVSERVE_KV_DISK_SIZE, else 2GiB
    # redis://[:password@]host:port/db or rediss://; a cluster: redis+cluster://[user:password@]host:port[,host:port...]
    # or rediss+cluster://
    kv_remote: str | None = None
    kv_write_policy: str = "write_back"  # or write_through (SGLang's names)
    # KV events (kv_events/), in vLLM's wire format; None: none published
    kv_events_endpoint: str | None = None  # e.g. tcp://*:5557 (bound; a host without * is connected to)
    kv_events_replay_endpoint: str | None = None  # default: the same host, port + 1
    kv_events_topic: str = ""  # vLLM's default
    kv_events_token_ids: bool = False  # publish blocks' token ids too (vLLM always does: every tenant's prompts)
    kv_events_encoding: str = "map"  # events as tagged maps (vLLM now) or tagged arrays (vLLM before #42892)
    # prefill/decode disaggregation: what this replica does (vLLM's kv_producer / kv_consumer / both)
    role: str = "both"  # "prefill": holds a finished prompt's blocks for a decode replica to pull
    kv_lease_seconds: float = 30.0  # how long a prefill replica holds handed-off blocks unpulled
    kv_load_failure_policy: str = "recompute"  # a decode replica's failed pull: compute instead, or "fail"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if parse_memory(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}")
        if self.prefix_cache not in ("radix", "hash"):
            raise ValueError(f"prefix_cache must be 'radix' or 'hash', got {self.prefix_cache!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        for name in ("kv_host_memory", "kv_disk_size"):
            value = getattr(self, name)
            if value is not None and parse_memory(value, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if self.kv_remote is not None and not self.kv_remote.startswith(KV_REMOTE_SCHEMES):
            raise ValueError(f"kv_remote must be a {', '.join(KV_REMOTE_SCHEMES)} URL, got {self.kv_remote!r}")
        if self.kv_write_policy not in ("write_back", "write_through"):
            raise ValueError(f"kv_write_policy must be 'write_back' or 'write_through', got {self.kv_write_policy!r}")
        self._check_kv_events()
        self._check_disaggregation()

    def _check_disaggregation(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not self.kv_lease_seconds > 0:
            raise ValueError(f"kv_lease_seconds must be > 0, got {self.kv_lease_seconds}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure_policy must be 'recompute' or 'fail', got {self.kv_load_failure_policy!r}"
            )

    def _check_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"tcp://\S+:(\d+|\*)|(ipc|inproc)://\S+", value):
                raise ValueError(f"{name} must look like tcp://*:5557, ipc://path or inproc://name, got {value!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_encoding not in ("map", "array"):
            raise ValueError(f"kv_events_encoding must be 'map' or 'array', got {self.kv_events_encoding!r}")

    def kv_disk_path(self) -> Path:
        return Path(self.kv_disk_dir).expanduser() if self.kv_disk_dir else cache_root() / "kv"

    def kv_disk_bytes(self) -> int:
        size = self.kv_disk_size if self.kv_disk_size is not None else os.environ.get("KVSERVE_KV_DISK_SIZE", "2GiB")
        return parse_memory(size, "kv_disk_size")

    def kv_host_bytes(self, on_accelerator: bool) -> int:
        default = "4GiB" if on_accelerator else 0
        return parse_memory(self.kv_host_memory if self.kv_host_memory is not None else default, "kv_host_memory")
