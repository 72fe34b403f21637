"""One pool, a prefix cache per KV group: the pool sees them as one evictor.

Each cached block belongs to exactly one group's cache (a block serves one group while it
is allocated, and is evicted before it can serve another), so lock and unlock go to the
cache that holds the block. Eviction takes from the cache with the most evictable blocks
first, a block at a time: a prefix hit needs blocks in every group, so no group's cache
should be emptied while another keeps everything.
"""

from __future__ import annotations

from kvserve.kv_cache.block_pool import KVCacheBlock
from kvserve.kv_cache.prefix_cache import PrefixCache


class GroupedEvictor:
    def __init__(self, caches: list[PrefixCache]):
        self.caches = caches

    @property
    def num_evictable_blocks(self) -> int:
        return sum(c.num_evictable_blocks for c in self.caches)

    def _by_cache(self, blocks: list[KVCacheBlock]) -> list[tuple[PrefixCache, list[KVCacheBlock]]]:
        parts = [(c, [b for b in blocks if c.holds(b)]) for c in self.caches]
        assert sum(len(p) for _, p in parts) == len(blocks), "a cached block no group's cache holds"
        return [(c, p) for c, p in parts if p]

    def lock(self, blocks: list[KVCacheBlock]) -> None:
        for cache, part in self._by_cache(blocks):
            cache.lock(part)

    def unlock(self, blocks: list[KVCacheBlock]) -> None:
        for cache, part in self._by_cache(blocks):
            cache.unlock(part)

    def evict(self, n: int) -> list[KVCacheBlock]:
        evicted: list[KVCacheBlock] = []
        while len(evicted) < n:
            cache = max(self.caches, key=lambda c: c.num_evictable_blocks)
            if cache.num_evictable_blocks == 0:
                break
            evicted += cache.evict(1)
        return evicted
