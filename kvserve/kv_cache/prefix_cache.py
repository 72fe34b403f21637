"""The prefix cache interface, shared by `RadixCache` and `HashChainCache`.

A prefix cache maps token prefixes (at block granularity, under an extra key such
as a tenant's salt) to the KV blocks that hold them. It owns the cached blocks
nobody references ("evictable"): they stay matchable until an allocation needs
them. Blocks in use are counted by the pool's reference counts; `lock`/`unlock`
tell the cache when a cached block's count leaves or reaches zero.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv_cache.block_pool import KVCacheBlock


def extra_key(cache_salt: str | None = None, adapter_id: str | None = None) -> bytes:
    """What partitions the cache besides tokens; salts enter only as a digest."""
    if cache_salt is None and adapter_id is None:
        return b""
    h = hashlib.sha256()
    for part in (cache_salt or "", adapter_id or ""):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two pairs can collide
        h.update(data)
    return h.digest()


@dataclass(frozen=True)
class PrefixMatch:
    blocks: list[KVCacheBlock]  # the cached blocks of the longest matching prefix, in order
    handle: object  # where `insert` continues this prefix (a radix node, or a block hash)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True)
class CacheSize:
    cached_blocks: int  # held by the cache, evictable or in use
    evictable_blocks: int


class PrefixCache(ABC):
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.num_evictions = 0  # cumulative, blocks

    @abstractmethod
    def match_prefix(
        self, token_ids: Sequence[int], extra_key: bytes, block_keys: Sequence[bytes] | None = None
    ) -> PrefixMatch:
        """Longest cached prefix of `token_ids` (whole blocks only). Changes no ref count.

        `block_keys`, where the caller has them, are the chained keys of `token_ids`' blocks
        (`block_keys.chain_keys`); a cache keyed by them need not compute them again."""

    @abstractmethod
    def insert(
        self,
        handle: object,
        token_ids: Sequence[int],
        blocks: list[KVCacheBlock],
        extra_key: bytes,
        block_keys: Sequence[bytes] | None = None,
    ) -> tuple[object, list[KVCacheBlock]]:
        """Cache full `blocks` holding `token_ids` (whose chained keys are `block_keys`, if
        given), continuing the prefix at `handle`.

        Returns the new handle and, per block, the block the cache now holds for it:
        the same one, or an already cached copy of the same prefix (the caller then
        switches to that one and frees its duplicate).
        """

    @abstractmethod
    def lock(self, blocks: list[KVCacheBlock]) -> None: ...

    @abstractmethod
    def unlock(self, blocks: list[KVCacheBlock]) -> None: ...

    @abstractmethod
    def evict(self, n: int) -> list[KVCacheBlock]: ...

    @property
    @abstractmethod
    def num_evictable_blocks(self) -> int: ...

    @abstractmethod
    def holds(self, block: KVCacheBlock) -> bool:
        """The block is cached here (several KV groups' caches share one pool)."""

    @abstractmethod
    def size_info(self) -> CacheSize: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the cache's own invariants (tests call this after every operation)."""

    def root_handle(self, extra_key: bytes) -> object:
        """The handle of the empty prefix."""
        return self.match_prefix((), extra_key).handle
