"""Block K/V between the device pool and the tiers' bytes.

A stored block is [layers, 2 (K, V), block_size, kv_heads, head_dim], contiguous
(`tiers.namespace.KV_LAYOUT_VERSION`); with several KV groups, "layers" are the KV
tensors (`KVCacheConfig.num_slots`), which hold a block's group's layers. Where the pool
is host memory and the platform has a kernel for it (`Platform.block_copy`), blocks go
straight between their bytes and the pool, a memcpy per layer and K/V part. Otherwise a
batch travels as one staging tensor and is scattered per layer on the device (on a CPU,
torch's index ops on bf16 move 1-2 GB/s that way).
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.kv_cache.kv_cache_manager import BlockLoad, BlockSave
from kvserve.kv_cache.tiers.store import TieredKVStore
from kvserve.platforms.interface import HostBlockCopy


def block_shape(kv_caches: list[torch.Tensor]) -> tuple[int, ...]:
    _, _, block_size, heads, head_dim = kv_caches[0].shape
    return (len(kv_caches), 2, block_size, heads, head_dim)


class KVTransfer:
    def __init__(self, kv_caches: list[torch.Tensor], store: TieredKVStore | None, copier: HostBlockCopy | None):
        self.kv_caches = kv_caches
        self.store = store
        self.shape = block_shape(kv_caches)
        self.dtype = kv_caches[0].dtype
        self.copier = copier

    def save(self, saves: list[BlockSave]) -> None:
        """Read out the blocks the store wants (before anything overwrites them) and hand them over."""
        for filled in (True, False):
            batch = [s for s in saves if s.filled == filled]
            if not batch:
                continue
            wanted = self.store.wanted([s.block_key for s in batch], filled)
            batch = [s for s, w in zip(batch, wanted, strict=True) if w]
            if batch:
                payloads = self.read([s.block_id for s in batch])
                announced = [s.block_key for s in batch if s.group == 0]
                self.store.save([s.block_key for s in batch], payloads, filled, announced)

    def load(self, loads: list[BlockLoad]) -> None:
        if not loads:
            return
        if self.copier is not None:
            self.copier.scatter(self.kv_caches, [x.payload for x in loads], [x.block_id for x in loads])
            return
        self._load_staged(loads)

    def _load_staged(self, loads: list[BlockLoad]) -> None:
        buf = torch.empty((len(loads), *self.shape), dtype=self.dtype)
        raw = buf.view(torch.uint8).numpy().reshape(len(loads), -1)
        for i, load in enumerate(loads):
            raw[i] = np.frombuffer(load.payload, dtype=np.uint8)
        buf = buf.to(self.kv_caches[0].device)
        ids = torch.tensor([load.block_id for load in loads], device=buf.device)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, ids] = buf[:, layer].transpose(0, 1)

    def read_into(self, block_ids: list[int], buffers: list[memoryview]) -> None:
        """The blocks' bytes into writable buffers of a block each."""
        if self.copier is not None:
            self.copier.gather_into(self.kv_caches, block_ids, buffers)
            return
        for buffer, payload in zip(buffers, self.read(block_ids), strict=True):
            buffer[:] = payload

    def read(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes, one payload each: into the store's buffers where it has them (host
        RAM's arena, kept as they are), else views of one array, each keeping it alive until the
        tiers (or a decode replica's pull) let go of it."""
        if self.copier is not None:
            buffers = self.store.payload_buffers(len(block_ids)) if self.store is not None else None
            if buffers is not None:
                self.copier.gather_into(self.kv_caches, block_ids, buffers)
                return buffers
            return [memoryview(row) for row in self.copier.gather(self.kv_caches, block_ids).numpy()]
        ids = torch.tensor(block_ids, device=self.kv_caches[0].device)
        per_layer = [cache[:, ids] for cache in self.kv_caches]  # each [2, n, block_size, heads, head_dim]
        data = torch.stack(per_layer, dim=1).transpose(0, 2).contiguous().cpu()  # [n, layers, 2, ...]
        return [memoryview(row) for row in data.view(torch.uint8).numpy().reshape(len(block_ids), -1)]
