"""The physical KV blocks: reference counts, a free queue, and the prefix cache's evictable ones.

The free queue is an intrusive doubly linked list (as in vLLM v1): taking a block
from the front, appending at the back and removing one from the middle are all
O(1), with no per-operation allocation. The hash-chain prefix cache keeps its
evictable blocks in the same kind of list, where a cache hit takes a block out of
the middle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    cached: bool = False  # held by the prefix cache: matchable by later requests
    block_key: bytes | None = None  # its key outside the engine (`group_key`), while a prefix cache holds it
    group: int = 0  # the KV group whose prefix cache holds it
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)

    @property
    def is_free(self) -> bool:
        return self.ref_cnt == 0


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels; front = evicted first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVCacheBlock:
        if self._len == 0:
            raise IndexError("no free block")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1


class Evictor(Protocol):
    """The prefix cache, as the pool sees it: it holds the free-but-cached blocks."""

    @property
    def num_evictable_blocks(self) -> int: ...

    def lock(self, blocks: list[KVCacheBlock]) -> None:
        """Cached blocks just got their first reference: they are no longer evictable."""

    def unlock(self, blocks: list[KVCacheBlock]) -> None:
        """Cached blocks just lost their last reference: they become evictable."""

    def evict(self, n: int) -> list[KVCacheBlock]:
        """Forget up to n evictable blocks (least recently used leaves first) and return them."""
        ...


class BlockPool:
    """Every block is free (in the free queue), evictable (held by the prefix cache,
    unreferenced, still matchable) or in use (ref_cnt > 0)."""

    def __init__(
        self,
        num_blocks: int,
        evictor: Evictor | None = None,
        on_evict: Callable[[list[KVCacheBlock]], None] | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.evictor = evictor
        self.on_evict = on_evict  # sees evicted blocks before they are reused (their K/V still intact)
        self.num_allocations = 0  # cumulative, for stats and tests

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_evictable_blocks(self) -> int:
        return self.evictor.num_evictable_blocks if self.evictor else 0

    @property
    def num_available_blocks(self) -> int:
        """What an allocation can get: free blocks, then evicted ones."""
        return self.num_free_blocks + self.num_evictable_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_available_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_available_blocks:
            raise ValueError(f"cannot take {n} blocks: only {self.num_available_blocks} available")
        if n > self.num_free_blocks:
            self.reclaim(n - self.num_free_blocks)
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            block.ref_cnt = 1
        self.num_allocations += n
        return blocks

    def reclaim(self, n: int) -> None:
        """Evict n cached, unreferenced blocks from the prefix cache into the free queue."""
        evicted = self.evictor.evict(n)
        if self.on_evict is not None:
            self.on_evict(evicted)
        for block in evicted:
            self.free_queue.append(block)

    def incr_ref(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Share blocks with one more owner (a fork, or a prefix-cache hit)."""
        revived = []
        for block in blocks:
            if block.ref_cnt == 0:
                if block.cached:
                    revived.append(block)
                else:
                    self.free_queue.remove(block)
            block.ref_cnt += 1
        if revived:
            self.evictor.lock(revived)

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each. Unreferenced blocks become free, or evictable if cached.

        Callers pass a request's blocks tail first, so that later blocks of a prefix
        are evicted before the earlier ones they depend on.
        """
        released = []
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.cached:
                    released.append(block)
                else:
                    self.free_queue.append(block)
        if released:
            self.evictor.unlock(released)

    def check_integrity(self) -> None:
        """Free + evictable + used = total; the queue holds exactly the unreferenced, uncached blocks."""
        queued = {b.block_id for b in self.free_queue}
        unreferenced = {b.block_id for b in self.blocks if b.ref_cnt == 0 and not b.cached}
        assert len(queued) == self.num_free_blocks, "free queue holds a block twice"
        assert queued == unreferenced, f"free queue {sorted(queued)} != free and uncached {sorted(unreferenced)}"
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        evictable = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.cached)
        assert evictable == self.num_evictable_blocks, f"{evictable} evictable, cache says {self.num_evictable_blocks}"
