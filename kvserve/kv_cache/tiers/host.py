"""Host RAM: an LRU of tier key -> payload copy, the first tier below the device pool.

In-process memory cannot be torn or corrupted behind our back, so payloads are kept as
plain bytes, not records. What a put pushes out is handed back for the tier below.

Given a block size (`slot_bytes`, as the engine does), the copies live in a `SlotArena`
and a save can gather a block straight into one (`buffers`), which the put then keeps
as it is: one copy from the device pool, into memory that is already mapped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.kv_cache.tiers.arena import SlotArena
from kvserve.kv_cache.tiers.base import KVTier


class HostTier(KVTier):
    name = "host"

    def __init__(self, capacity_bytes: int, slot_bytes: int = 0) -> None:
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self.arena = SlotArena(slot_bytes) if slot_bytes else None
        self._entries: OrderedDict[bytes, bytes | memoryview] = OrderedDict()  # oldest first
        self._used = 0
        self._lock = threading.Lock()

    def contains(self, keys: Sequence[bytes]) -> int:
        # a probe, not a use: only `get` refreshes recency
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._entries:
                    break
                n += 1
            return n

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = []
        with self._lock:
            for key in keys:
                payload = self._entries.get(key)
                if payload is not None:
                    self._entries.move_to_end(key)
                out.append(payload)
        found = [p for p in out if p is not None]
        self.stats.add(queries=len(keys), hits=len(found), read_bytes=sum(len(p) for p in found))
        return out

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[tuple[bytes, bytes | memoryview]]:
        evicted: list[tuple[bytes, bytes | memoryview]] = []
        stored = written = dropped = 0
        with self._lock:
            for key, payload in items:
                if key in self._entries:
                    self._entries.move_to_end(key)
                    continue
                view = memoryview(payload).cast("B")  # counts bytes, whatever the buffer's item format
                if view.nbytes > self._capacity:
                    dropped += 1
                    continue
                self._entries[key] = self._own(view)
                self._used += view.nbytes
                stored, written = stored + 1, written + view.nbytes
                evicted.extend(self._evict_over_capacity())
        self.stats.add(stored_blocks=stored, written_bytes=written, dropped_writes=dropped)
        return evicted

    def buffers(self, n: int) -> list[memoryview] | None:
        """n writable block buffers from the arena, for payloads `put` will keep without a copy
        (None without an arena); one not put goes back to the arena when dropped."""
        return None if self.arena is None else [memoryview(self.arena.take()) for _ in range(n)]

    def _own(self, view: memoryview) -> bytes | memoryview:
        """The payload as this tier keeps it: an arena buffer as it is, anything else copied
        (the caller may reuse its buffer)."""
        if self.arena is None:
            return bytes(view)
        if self.arena.owns(view.obj):
            return view
        if view.nbytes != self.arena.slot_bytes:
            raise ValueError(f"payload of {view.nbytes} bytes, a slot here is {self.arena.slot_bytes}")
        buf = self.arena.take()
        buf[:] = view
        return memoryview(buf)

    def _evict_over_capacity(self) -> list[tuple[bytes, bytes | memoryview]]:
        """Caller holds the lock."""
        evicted = []
        while self._used > self._capacity:
            key, payload = self._entries.popitem(last=False)
            self._used -= len(payload)
            evicted.append((key, payload))
        return evicted

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()

    def __len__(self) -> int:
        return len(self._entries)
