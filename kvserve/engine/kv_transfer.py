"""Block K/V between the device pool and the tiers' bytes.

A stored block is [layers, 2 (K, V), block_size, kv_heads, head_dim], contiguous
(`tiers.namespace.KV_LAYOUT_VERSION`); with several KV groups, "layers" are the KV
tensors (`KVCacheConfig.num_slots`), which hold a block's group's layers. On a CPU the
pool is host memory, so the copies go through numpy views of it: a save gathers a batch
of blocks with one fancy index per layer, a load copies each payload's bytes straight
into its block (one copy; torch's index ops on bf16 through a staging tensor moved 0.3-1
GB/s). On an accelerator a batch travels as one staging tensor and is scattered per
layer on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.kv_cache.kv_cache_manager import BlockLoad, BlockSave
from kvserve.kv_cache.tiers.store import TieredKVStore


def block_shape(kv_caches: list[torch.Tensor]) -> tuple[int, ...]:
    _, _, block_size, heads, head_dim = kv_caches[0].shape
    return (len(kv_caches), 2, block_size, heads, head_dim)


class KVTransfer:
    def __init__(self, kv_caches: list[torch.Tensor], store: TieredKVStore):
        self.kv_caches = kv_caches
        self.store = store
        self.shape = block_shape(kv_caches)
        self.dtype = kv_caches[0].dtype
        on_cpu = kv_caches[0].device.type == "cpu"
        self.host_views = [_bytes_view(c) for c in kv_caches] if on_cpu else None  # [2, blocks, bytes]

    def save(self, saves: list[BlockSave]) -> None:
        """Read out the blocks the store wants (before anything overwrites them) and hand them over."""
        for filled in (True, False):
            batch = [s for s in saves if s.filled == filled]
            if not batch:
                continue
            wanted = self.store.wanted([s.block_key for s in batch], filled)
            batch = [s for s, w in zip(batch, wanted, strict=True) if w]
            if batch:
                data = self._gather([s.block_id for s in batch])
                announced = [s.block_key for s in batch if s.group == 0]
                self.store.save([s.block_key for s in batch], _payloads(data), filled, announced)

    def load(self, loads: list[BlockLoad]) -> None:
        if not loads:
            return
        if self.host_views is None:
            self._load_device(loads)
            return
        for load in loads:
            src = np.frombuffer(load.payload, dtype=np.uint8).reshape(len(self.host_views), 2, -1)
            for layer, view in enumerate(self.host_views):
                view[:, load.block_id] = src[layer]

    def _load_device(self, loads: list[BlockLoad]) -> None:
        buf = torch.empty((len(loads), *self.shape), dtype=self.dtype)
        raw = buf.view(torch.uint8).numpy().reshape(len(loads), -1)
        for i, load in enumerate(loads):
            raw[i] = np.frombuffer(load.payload, dtype=np.uint8)
        buf = buf.to(self.kv_caches[0].device)
        ids = torch.tensor([load.block_id for load in loads], device=buf.device)
        for layer, cache in enumerate(self.kv_caches):
            cache[:, ids] = buf[:, layer].transpose(0, 1)

    def _gather(self, block_ids: list[int]) -> np.ndarray:
        """The blocks' bytes, [n, layers * 2 * block bytes]."""
        if self.host_views is None:
            ids = torch.tensor(block_ids, device=self.kv_caches[0].device)
            per_layer = [cache[:, ids] for cache in self.kv_caches]  # each [2, n, block_size, heads, head_dim]
            data = torch.stack(per_layer, dim=1).transpose(0, 2).contiguous().cpu()  # [n, layers, 2, ...]
            return data.view(torch.uint8).numpy().reshape(len(block_ids), -1)
        ids = np.asarray(block_ids)
        out = np.empty((len(block_ids), len(self.host_views), *self.host_views[0][:, 0].shape), dtype=np.uint8)
        for layer, view in enumerate(self.host_views):
            out[:, layer] = view[:, ids].swapaxes(0, 1)
        return out.reshape(len(block_ids), -1)


def _bytes_view(cache: torch.Tensor) -> np.ndarray:
    return cache.view(torch.uint8).numpy().reshape(cache.shape[0], cache.shape[1], -1)


def _payloads(data: np.ndarray) -> list[memoryview]:
    """One view per block; each keeps `data` alive until the tiers let go of it."""
    return [memoryview(row) for row in data]
