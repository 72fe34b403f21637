"""Buffers for the records of many blocks at once (a prefill/decode handoff's ~100 MB).

Anonymous mappings whose pages the kernel maps in before they are handed out (MAP_POPULATE),
kept and handed out again once nothing references them. A fresh mapping's pages cost their
first touch each time: a pull read into one ran at 0.4-0.57 GB/s; asked for transparent huge
pages, at ~2 GB/s but with stalls of up to 0.5 s (the kernel compacting memory for them);
populated, 31 ms to 0.26 s for 94 MB (in a KVM guest the host may back every page anew). A
mapping used before costs nothing: a pull read into one ran at 2.3-2.5 GB/s (AMD EPYC Zen 4).
"""

from __future__ import annotations

import mmap
import threading

# Linux only; elsewhere pages fault in on first touch
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
_STEP = 16 << 20  # mapped sizes rounded up to this: the next pull of a few blocks more still fits


def _in_use(region: mmap.mmap) -> bool:
    """Whether a view of the mapping is alive (an mmap refuses to resize while one is)."""
    try:
        region.resize(len(region))
    except BufferError:
        return True
    return False


class BufferPool:
    """Writable buffers of any size, their contents left from earlier use; up to `keep` mappings are
    kept for reuse, each handed out again once every view of it is gone."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._regions: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        if nbytes == 0:
            return memoryview(bytearray())
        with self._lock:
            free = [r for r in self._regions if not _in_use(r)]
            fits = [r for r in free if len(r) >= nbytes]
            if fits:
                return memoryview(min(fits, key=len))[:nbytes]
            region = mmap.mmap(-1, -(-nbytes // _STEP) * _STEP, flags=_FLAGS)
            if len(self._regions) >= self._keep and free:
                self._regions.remove(min(free, key=len))  # unmapped: nothing views it
            if len(self._regions) < self._keep:
                self._regions.append(region)
            return memoryview(region)[:nbytes]  # viewed before the lock is let go: no other take gets it
