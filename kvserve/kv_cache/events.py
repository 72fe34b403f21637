"""What the KV cache announces: blocks stored, blocks removed, everything cleared.

The fields are vLLM's (`vllm.distributed.kv_events`), so that consumers written for
vLLM read kvserve's events too; `kvserve.kv_events` puts them on the wire. A block's
hash is its chained key (`block_keys`), which has the tenant salt's digest inside it;
token ids are filled in only when the operator opts in.
"""

from __future__ import annotations

from dataclasses import dataclass

# `medium`, in vLLM's words (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE): "GPU" is the device pool,
# whatever the device; "CPU" host RAM; "STORAGE" the disk tier
DEVICE, HOST, DISK = "GPU", "CPU", "STORAGE"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # empty unless token ids are published (an opt-in)
    block_size: int
    lora_id: int | None = None
    medium: str | None = DEVICE


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
