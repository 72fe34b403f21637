"""Block-sized buffers for host RAM and disk reads, carved from large mappings and reused.

A fresh buffer per stored block costs its first writes to fresh pages, ~90 of them for
one of SmolLM2's 368,640-byte blocks, and under KVM those run at 1-1.5 GB/s: the copy
into host RAM and the staging buffer a save gathered into ran at 0.5-2.5 GB/s. Here a
save gathers straight into a slot of a mapping of up to 64 MiB (one copy), and a slot
comes back for reuse once nothing refers to its buffer: not the tier, not a load still
to be scattered, not the disk writer still writing an evicted block. CPython drops a
buffer as its last reference goes, so a slot is never reused while someone can read it.
The next mapping is written to on a thread of its own while the current one fills, so
a tier that is still filling copies into pages already mapped, as one that recycles.
The arena never shrinks: it holds the tier's blocks, those in flight and one mapping,
up to `max_bytes` if given (past it, `try_take` says no and the caller allocates).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import numpy as np

CHUNK_BYTES = 64 << 20
MAX_CHUNK_SLOTS = 1024  # small slots (tests' blocks) in smaller mappings


class SlotArena:
    def __init__(self, slot_bytes: int, max_bytes: int | None = None) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self._per_chunk = max(1, min(MAX_CHUNK_SLOTS, CHUNK_BYTES // slot_bytes))
        chunk_bytes = self._per_chunk * slot_bytes
        self._max_chunks = None if max_bytes is None else max(1, max_bytes // chunk_bytes)
        self._chunks: list[np.ndarray] = []  # each [slots, slot_bytes] uint8
        self._free: list[int] = []
        self._taken: dict[int, int] = {}  # id of a buffer handed out -> its slot
        # re-entrant: a buffer dropped by a garbage collection inside `take` releases its slot
        self._lock = threading.RLock()
        self._mapper = ThreadPoolExecutor(1, thread_name_prefix="kv-arena")
        self._spare: Future[np.ndarray] | None = None  # the next mapping, being written to

    def take(self) -> np.ndarray:
        """A writable buffer of `slot_bytes`, its slot free again when the buffer is dropped."""
        buf = self.try_take()
        if buf is None:
            raise MemoryError(f"slot arena full: {self.num_slots} slots of {self.slot_bytes} bytes taken")
        return buf

    def try_take(self) -> np.ndarray | None:
        """As `take`, or None when every slot is taken and the arena is at `max_bytes`."""
        with self._lock:
            if not self._free:
                if self._max_chunks is not None and len(self._chunks) >= self._max_chunks:
                    return None
                self._grow()
            slot = self._free.pop()
            buf = self._chunks[slot // self._per_chunk][slot % self._per_chunk]
            self._taken[id(buf)] = slot
        weakref.finalize(buf, self._release, id(buf), slot)
        return buf

    def owns(self, buf: object) -> bool:
        """Whether `buf` is a buffer this arena handed out (and still alive)."""
        with self._lock:
            return id(buf) in self._taken

    @property
    def num_slots(self) -> int:
        return len(self._chunks) * self._per_chunk

    @property
    def num_free(self) -> int:
        return len(self._free)

    def close(self) -> None:
        self._mapper.shutdown(wait=False, cancel_futures=True)

    def _grow(self) -> None:
        """Caller holds the lock."""
        spare, self._spare = self._spare, None
        try:
            chunk = spare.result() if spare is not None else self._map(touch=False)
        except CancelledError:  # closed meanwhile
            chunk = self._map(touch=False)
        if self._max_chunks is None or len(self._chunks) + 1 < self._max_chunks:
            try:
                self._spare = self._mapper.submit(self._map, touch=True)
            except RuntimeError:  # closed: no spare any more
                pass
        first = self.num_slots
        self._chunks.append(chunk)
        self._free.extend(range(first + self._per_chunk - 1, first - 1, -1))  # lowest slot first

    def _map(self, touch: bool) -> np.ndarray:
        mapping = mmap.mmap(-1, self._per_chunk * self.slot_bytes)
        chunk = np.frombuffer(mapping, dtype=np.uint8).reshape(self._per_chunk, self.slot_bytes)
        if touch:
            chunk.reshape(-1)[:: mmap.PAGESIZE] = 0  # a write per page maps it (numpy lets go of the GIL)
        return chunk

    def _release(self, buf_id: int, slot: int) -> None:
        with self._lock:
            del self._taken[buf_id]
            self._free.append(slot)
