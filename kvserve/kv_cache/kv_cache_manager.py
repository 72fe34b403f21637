"""What the scheduler talks to: allocate slots, fork (copy-on-write), free.

Each request owns a `BlockTable`, its physical blocks in logical order. Blocks are
taken only when tokens are about to be written and given back the moment a
request finishes, is aborted or preempted. A failed allocation changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.request import Request
from kvserve.kv_cache.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: copy K/V of block `src` into `dst` before this step's forward."""

    src: int
    dst: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[int, list[KVCacheBlock]] = {}  # by Request.seq_id
        self.pending_copies: list[BlockCopy] = []
        self.num_cow_copies = 0

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request.seq_id, ())]

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks (plus a copy-on-write one) that writing these tokens takes."""
        table = self.block_tables.get(request.seq_id, [])
        start = request.num_computed_tokens
        grow = max(0, cdiv(start + num_new_tokens, self.block_size) - len(table))
        return grow + int(self._shared_tail(table, start) is not None)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for the next `num_new_tokens` of `request`; False (and no change) if out of blocks."""
        if self.blocks_needed(request, num_new_tokens) > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request.seq_id, [])
        start = request.num_computed_tokens
        shared = self._shared_tail(table, start)
        if shared is not None:
            self._copy_on_write(table, shared)
        grow = cdiv(start + num_new_tokens, self.block_size) - len(table)
        if grow > 0:
            table.extend(self.pool.get_new_blocks(grow))
        return True

    def _shared_tail(self, table: list[KVCacheBlock], start: int) -> int | None:
        """Index of the partly filled block the next token goes into, if others share it."""
        idx = start // self.block_size
        if start % self.block_size and idx < len(table) and table[idx].ref_cnt > 1:
            return idx
        return None

    def _copy_on_write(self, table: list[KVCacheBlock], idx: int) -> None:
        old = table[idx]
        (new,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([old])  # the other owners keep it
        table[idx] = new
        self.pending_copies.append(BlockCopy(old.block_id, new.block_id))
        self.num_cow_copies += 1

    def take_pending_copies(self) -> list[BlockCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent, the partly filled last one too."""
        table = self.block_tables[parent.seq_id]
        self.pool.incr_ref(table)
        self.block_tables[child.seq_id] = list(table)

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.seq_id, [])
        self.pool.free_blocks(reversed(table))  # tail first: evicted before its prefix
