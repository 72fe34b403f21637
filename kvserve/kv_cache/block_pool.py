"""The physical KV blocks: reference counts and a free queue in eviction order.

The free queue is an intrusive doubly linked list (as in vLLM v1): taking a block
from the front, appending at the back and removing one from the middle (a cached
block that a new request reuses) are all O(1), with no per-operation allocation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
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


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.num_allocations = 0  # cumulative, for stats and tests

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks: only {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for block in blocks:
            block.ref_cnt = 1
        self.num_allocations += n
        return blocks

    def incr_ref(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Share blocks with one more owner (a fork, or a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each; blocks reaching 0 go to the back of the free queue.

        Callers pass a request's blocks tail first, so that later blocks of a prefix
        are evicted before the earlier ones they depend on.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed twice")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        """Free + used = total, and the queue holds exactly the unreferenced blocks."""
        queued = {b.block_id for b in self.free_queue}
        unreferenced = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert len(queued) == self.num_free_blocks, "free queue holds a block twice"
        assert queued == unreferenced, f"free queue {sorted(queued)} != ref 0 {sorted(unreferenced)}"
        assert all(b.ref_cnt >= 0 for b in self.blocks)
