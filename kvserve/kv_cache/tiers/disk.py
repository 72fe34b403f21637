"""Local disk: one checked record file per block, the last local tier.

    <directory>/<namespace digest, 16 hex>/<key, 2 hex>/<key, 64 hex>.kv

Each engine configuration (namespace) has its own folder, so engines of different models
or KV layouts can share a directory without seeing, counting or evicting each other's
blocks. Files are written to a temporary name and renamed into place, so a reader sees
a whole record or none; a record torn by a crash or flipped on disk fails its checks
and is a miss. The index (key -> file size, oldest first) lives in memory and is rebuilt
from the folder at start, in mtime order.

Reads land in recycled buffers (a `SlotArena`): reading into fresh memory costs its first
writes to fresh pages, which held a read from the page cache to ~1.6 GB/s under KVM
against ~5 GB/s into memory already mapped. The arena holds only blocks being loaded,
up to READ_ARENA_BYTES; a bigger load reads the rest into fresh memory, the same way.

An I/O fault (disk full, permissions, a failing device) makes the tier step aside through
a circuit breaker: reads miss and writes are dropped, at no cost, until a probe succeeds.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

from kvserve.kv_cache.tiers import record
from kvserve.kv_cache.tiers.arena import SlotArena
from kvserve.kv_cache.tiers.base import KVTier
from kvserve.kv_cache.tiers.breaker import BreakerState, CircuitBreaker
from kvserve.kv_cache.tiers.namespace import Namespace
from kvserve.logger import logger

SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
STALE_TMP_SECONDS = 60.0  # a write takes milliseconds: an older temporary file was left by a crash
READ_WINDOW = 64  # files open at once in a get: the read-ahead's reach, well under the open-files limit
READ_ARENA_BYTES = 256 << 20  # ~350 of SmolLM2's fp32 blocks, a 5.5k-token load


class DiskTier(KVTier):
    name = "disk"

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        namespace: Namespace,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.namespace = namespace
        self.directory = Path(directory) / namespace.digest.hex()[:16]
        self._folder = str(self.directory)
        self._capacity = capacity_bytes
        self._file_size = record.header_size(namespace) + namespace.block_nbytes
        self._read_arena = SlotArena(self._file_size + 1, READ_ARENA_BYTES)  # one byte more shows an overlong file
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._breaker = CircuitBreaker(failure_threshold=1, cooldown=5.0, max_cooldown=60.0, clock=clock)
        self._warned = False  # one warning per episode of faults
        self._started = False
        self._start()

    # --- the KVTier interface

    def contains(self, keys: Sequence[bytes]) -> int:
        if self._breaker.state == BreakerState.OPEN:
            return 0
        with self._lock:
            n = 0
            for key in keys:
                if key not in self._index:
                    break
                n += 1
            return n

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        out: list[bytes | memoryview | None] = [None] * len(keys)
        self.stats.add(queries=len(keys))
        with self._lock:
            wanted = [i for i, key in enumerate(keys) if key in self._index]
        # ask the breaker only when there is I/O to do: a half-open probe must end in success or failure
        if not wanted or not self._breaker.allow():
            return out
        fault: OSError | None = None
        try:
            for start in range(0, len(wanted), READ_WINDOW):
                window = wanted[start : start + READ_WINDOW]
                for i, payload in zip(window, self._read_window([keys[i] for i in window]), strict=True):
                    out[i] = payload
        except OSError as e:
            fault = e
        except BaseException:
            self._breaker.failure()  # never leave a probe unresolved: the breaker would stay open
            raise
        self._end_io(fault, "read")
        found = [p for p in out if p is not None]
        self.stats.add(hits=len(found), read_bytes=sum(len(p) for p in found))
        return out

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[tuple[bytes, None]]:
        """Returns the blocks evicted to make room, payload None: the last local tier deletes them."""
        views = [(key, self._check_payload(payload)) for key, payload in items]
        with self._lock:
            new, seen = [], set()
            for key, view in views:
                if key in self._index:
                    self._index.move_to_end(key)
                elif key not in seen:  # a key twice in one batch is written once
                    seen.add(key)
                    new.append((key, view))
        if not new:
            return []
        if self._file_size > self._capacity or not self._breaker.allow():
            self.stats.add(dropped_writes=len(new))
            return []
        written, fault = 0, None
        try:
            if not self._started:
                self._start_or_raise()
            for key, view in new:
                self._write(key, view)
                written += 1
        except OSError as e:
            fault = e
        except BaseException:
            self._breaker.failure()
            raise
        self._end_io(fault, "write")
        self.stats.add(stored_blocks=written, written_bytes=written * self.namespace.block_nbytes)
        self.stats.add(dropped_writes=len(new) - written)
        return [(key, None) for key in self._evict_over_capacity()]

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def available(self) -> bool:
        return self._breaker.state != BreakerState.OPEN

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        self._read_arena.close()

    # --- files

    def path(self, key: bytes) -> Path:
        return Path(self._path_str(key))

    def _path_str(self, key: bytes) -> str:
        name = key.hex()  # a string, not a Path: pathlib's joins cost more than a block's read from the page cache
        return f"{self._folder}/{name[:2]}/{name}{SUFFIX}"

    def _read_window(self, keys: list[bytes]) -> list[memoryview | None]:
        """Open every file of the window and ask the kernel for all of them at once: the device
        then serves them in parallel, where reading one file after another waits for each."""
        fds: list[int | None] = []
        try:
            for key in keys:
                try:
                    fd = os.open(self._path_str(key), os.O_RDONLY)
                except FileNotFoundError:  # deleted behind our back (another engine's eviction, a cleanup)
                    fd = None
                    self._forget(key)
                else:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                fds.append(fd)
            return [None if fd is None else self._read(key, fd) for key, fd in zip(keys, fds, strict=True)]
        finally:
            for fd in fds:
                if fd is not None:
                    os.close(fd)

    def _read(self, key: bytes, fd: int) -> memoryview | None:
        """The payload, or None for a bad file; raises OSError on an I/O fault."""
        data = self._read_file(fd)
        try:
            payload = record.decode(self.namespace, key, data)
        except record.BadRecord as e:
            logger.debug("disk KV tier: bad record %s (%s), deleted", key.hex(), e)
            self.stats.error("corrupt")
            self._forget(key)
            self._unlink(self.path(key))
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return payload

    def _read_file(self, fd: int) -> memoryview:
        """The file's bytes, up to one more than a record's size, in an arena slot if one is free."""
        buf = self._read_arena.try_take()
        view, n = memoryview(bytearray(self._file_size + 1) if buf is None else buf), 0
        while n < len(view) and (got := os.readv(fd, [view[n:]])):
            n += got
        return view[:n]

    def _write(self, key: bytes, view: memoryview) -> None:
        path = self.path(key)
        # unique per process and thread, in the same folder so that the rename is atomic
        tmp = path.with_name(f".{key.hex()}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            f = open(tmp, "wb")
        except FileNotFoundError:  # first block under this prefix, or the folder was removed behind us
            tmp.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "wb")
        try:
            with f:  # no fsync: a record lost or torn by a crash is only a miss
                f.write(record.header(self.namespace, key, view))
                f.write(view)
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise
        with self._lock:
            if key not in self._index:  # another thread may have written the same block meanwhile
                self._index[key] = self._file_size
                self._used += self._file_size
            self._index.move_to_end(key)

    def _evict_over_capacity(self) -> list[bytes]:
        with self._lock:
            victims = []
            while self._used > self._capacity and self._index:
                key, size = self._index.popitem(last=False)
                self._used -= size
                victims.append(key)
        for key in victims:
            self._unlink(self.path(key))
        return victims

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # not worth stepping aside for: the file is out of the index either way
            logger.debug("disk KV tier: could not delete %s: %s", path, e)

    # --- start and faults

    def _start(self) -> None:
        try:
            self._start_or_raise()
        except OSError as e:
            self._breaker.failure()
            self._fault(e, "start")

    def _start_or_raise(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        found = self._scan()
        found.sort()  # by mtime: the least recently written first
        with self._lock:
            for _, key, size in found:
                if key not in self._index:
                    self._index[key] = size
                    self._used += size
        self._started = True
        self._evict_over_capacity()  # the capacity may be smaller than last time

    def _scan(self) -> list[tuple[float, bytes, int]]:
        """(mtime, key, size) of this namespace's block files; removes stale temporary files."""
        found = []
        now = time.time()
        with os.scandir(self.directory) as subs:
            folders = [sub for sub in subs if len(sub.name) == 2 and sub.is_dir(follow_symlinks=False)]
        for sub in folders:
            with os.scandir(sub.path) as entries:
                for entry in entries:
                    try:
                        if entry.name.endswith(TMP_SUFFIX):
                            # another engine may be writing this one right now; only old ones are leftovers
                            if now - entry.stat().st_mtime > STALE_TMP_SECONDS:
                                self._unlink(Path(entry.path))
                        elif (key := _key_of(entry.name, sub.name)) is not None and entry.is_file():
                            st = entry.stat()
                            found.append((st.st_mtime, key, st.st_size))
                    except FileNotFoundError:  # removed while we looked (another engine's eviction)
                        continue
        return found

    def _end_io(self, fault: OSError | None, what: str) -> None:
        if fault is None:
            if self._warned:
                logger.info("disk KV tier at %s works again", self.directory)
                self._warned = False
            self._breaker.success()
        else:
            self._breaker.failure()
            self._fault(fault, what)

    def _fault(self, e: OSError, what: str) -> None:
        self.stats.error("io")
        if not self._warned:
            self._warned = True
            logger.warning("disk KV tier at %s: %s failed (%s); stepping aside", self.directory, what, e)

    def _check_payload(self, payload: bytes | memoryview) -> memoryview:
        view = memoryview(payload).cast("B")  # bytes, whatever the buffer's item format
        if view.nbytes != self.namespace.block_nbytes:
            raise ValueError(f"payload of {view.nbytes} bytes, a block here is {self.namespace.block_nbytes}")
        return view


def _key_of(name: str, folder: str) -> bytes | None:
    """The key a block file's name stands for, or None for any other file."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    if len(stem) != 64 or not stem.startswith(folder):
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None
