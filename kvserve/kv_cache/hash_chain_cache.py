"""Automatic prefix caching as in vLLM: one chained hash per full block.

A block's key is its chained block key (`block_keys`: SHA-256 over its parent's key,
the extra key and its token ids), so it names the whole prefix up to and including the
block. Matching walks the prompt block by block and stops at the first miss. Unreferenced cached blocks
wait in an LRU list (requests release their blocks tail first, so a chain's tail
is evicted before its parents) and stay matchable until an allocation takes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.block_pool import FreeBlockQueue, KVCacheBlock
from kvserve.kv_cache.prefix_cache import CacheSize, PrefixCache, PrefixMatch


class HashChainCache(PrefixCache):
    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.blocks_by_hash: dict[bytes, KVCacheBlock] = {}
        self.hash_of: dict[int, bytes] = {}  # block id -> its key
        self.evictable = FreeBlockQueue([])

    def _keys(self, parent: bytes, token_ids: Sequence[int], extra_key: bytes, keys: Sequence[bytes] | None):
        return chain_keys(parent, token_ids, self.block_size, extra_key) if keys is None else keys

    def match_prefix(
        self, token_ids: Sequence[int], extra_key: bytes, block_keys: Sequence[bytes] | None = None
    ) -> PrefixMatch:
        blocks: list[KVCacheBlock] = []
        last = b""
        for h in self._keys(b"", token_ids, extra_key, block_keys):
            block = self.blocks_by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
            last = h
        return PrefixMatch(blocks, last)

    def insert(
        self,
        handle: object,
        token_ids: Sequence[int],
        blocks: list[KVCacheBlock],
        extra_key: bytes,
        block_keys: Sequence[bytes] | None = None,
    ) -> tuple[object, list[KVCacheBlock]]:
        assert isinstance(handle, bytes)
        held = []
        for h, block in zip(self._keys(handle, token_ids, extra_key, block_keys), blocks, strict=True):
            if h not in self.blocks_by_hash:
                self.blocks_by_hash[h] = block
                self.hash_of[block.block_id] = h
                block.cached = True
            held.append(self.blocks_by_hash[h])
            handle = h
        return handle, held

    def lock(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self.evictable.remove(block)

    def unlock(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self.evictable.append(block)

    def evict(self, n: int) -> list[KVCacheBlock]:
        evicted = [self.evictable.popleft() for _ in range(min(n, len(self.evictable)))]
        for block in evicted:
            del self.blocks_by_hash[self.hash_of.pop(block.block_id)]
            block.cached = False
        self.num_evictions += len(evicted)
        return evicted

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable)

    def holds(self, block: KVCacheBlock) -> bool:
        return block.block_id in self.hash_of

    def size_info(self) -> CacheSize:
        return CacheSize(cached_blocks=len(self.hash_of), evictable_blocks=len(self.evictable))

    def check_integrity(self) -> None:
        assert {b.block_id: h for h, b in self.blocks_by_hash.items()} == self.hash_of, "hash maps disagree"
        assert all(b.cached for b in self.blocks_by_hash.values())
        queued = {b.block_id for b in self.evictable}
        unreferenced = {b.block_id for b in self.blocks_by_hash.values() if b.ref_cnt == 0}
        assert queued == unreferenced and len(queued) == len(self.evictable), "evictable list out of date"
