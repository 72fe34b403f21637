"""The local KV tiers (host RAM, disk) and the record format their blocks are checked with. No torch."""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
from array import array
from pathlib import Path

import pytest
import xxhash

from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.kv_cache.tiers import disk as disk_module
from kvserve.kv_cache.tiers import record
from kvserve.kv_cache.tiers.arena import MAX_CHUNK_SLOTS, SlotArena
from kvserve.kv_cache.tiers.disk import DiskTier
from kvserve.kv_cache.tiers.host import HostTier
from kvserve.kv_cache.tiers.namespace import Namespace, tier_key

NS = Namespace("fp", "float32", 4, (2, 2, 4, 1, 8))
BLOCK = NS.block_nbytes  # 512
FILE = record.header_size(NS) + BLOCK


def key(i: int) -> bytes:
    return tier_key(NS.digest, i.to_bytes(32, "little"))


def payload(i: int, n: int = BLOCK) -> bytes:
    return bytes((i + j) % 251 for j in range(n))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- host


ARENA = pytest.mark.parametrize("slot_bytes", [0, 100], ids=["copies", "arena"])


@ARENA
def test_host_evicts_least_recently_used_and_returns_the_evicted(slot_bytes):
    host = HostTier(capacity_bytes=3 * 100, slot_bytes=slot_bytes)
    assert host.put([(key(i), payload(i, 100)) for i in range(3)]) == []
    assert host.get([key(0)]) == [payload(0, 100)]  # 0 is now the most recently used
    assert host.contains([key(1)]) == 1  # a probe does not refresh recency
    evicted = host.put([(key(3), payload(3, 100))])
    assert evicted == [(key(1), payload(1, 100))]
    evicted = host.put([(key(4), payload(4, 100)), (key(5), payload(5, 100))])
    assert evicted == [(key(2), payload(2, 100)), (key(0), payload(0, 100))]
    assert host.get([key(3), key(1), key(5)]) == [payload(3, 100), None, payload(5, 100)]
    assert host.stats.queries == 4 and host.stats.hits == 3 and host.stats.read_bytes == 300


def test_host_capacity_holds_after_every_put():
    host = HostTier(capacity_bytes=1000)
    for i in range(50):
        evicted = host.put([(key(i), payload(i, 10 * (i % 13) + 1))])
        assert host.used_bytes <= host.capacity_bytes
        assert all(k != key(i) for k, _ in evicted)
    assert host.used_bytes == sum(len(p) for p in host.get([key(i) for i in range(50)]) if p is not None)


@ARENA
def test_host_contains_counts_leading_keys_and_put_of_a_present_key_only_touches(slot_bytes):
    host = HostTier(capacity_bytes=250, slot_bytes=slot_bytes)
    host.put([(key(0), payload(0, 100)), (key(1), payload(1, 100))])
    assert host.contains([key(0), key(1), key(2), key(0)]) == 2
    assert host.put([(key(0), payload(9, 100))]) == []  # already there: kept, made recent
    assert host.get([key(0)]) == [payload(0, 100)] and host.used_bytes == 200
    assert host.put([(key(2), payload(2, 100))]) == [(key(1), payload(1, 100))]


def test_host_copies_payloads_and_drops_the_oversized():
    host = HostTier(capacity_bytes=100)
    buf = bytearray(payload(0, 50))
    host.put([(key(0), memoryview(buf))])
    buf[:] = bytes(50)
    assert host.get([key(0)]) == [payload(0, 50)]
    assert host.put([(key(1), payload(1, 101))]) == []
    assert host.contains([key(1)]) == 0 and host.stats.dropped_writes == 1 and host.used_bytes == 50


def test_host_arena_keeps_its_own_buffers_copies_others_and_refuses_another_size():
    host = HostTier(capacity_bytes=300, slot_bytes=100)
    mine = host.buffers(1)[0]
    mine[:] = payload(0, 100)
    theirs = bytearray(payload(1, 100))
    host.put([(key(0), mine), (key(1), memoryview(theirs))])
    theirs[:] = bytes(100)
    got = host.get([key(0), key(1)])
    assert got == [payload(0, 100), payload(1, 100)]
    assert got[0].obj is mine.obj and host.arena.owns(got[1].obj)  # kept as given; copied into a slot
    with pytest.raises(ValueError, match="a slot here is 100"):
        host.put([(key(2), payload(2, 50))])


def test_host_arena_reuses_the_slots_of_dropped_blocks():
    host = HostTier(capacity_bytes=3 * 100, slot_bytes=100)
    for i in range(200):
        bufs = host.buffers(2)
        for j, b in enumerate(bufs):
            b[:] = payload(2 * i + j, 100)
        host.put([(key(2 * i + j), b) for j, b in enumerate(bufs)])
    del bufs
    assert host.get([key(399), key(398), key(397)]) == [payload(399, 100), payload(398, 100), payload(397, 100)]
    assert host.arena.num_slots - host.arena.num_free == 3 and host.arena.num_slots <= MAX_CHUNK_SLOTS  # one mapping


def test_a_bounded_arena_says_no_when_full_and_yes_once_a_buffer_is_dropped():
    arena = SlotArena(100, max_bytes=100 * MAX_CHUNK_SLOTS)  # one mapping
    taken = [arena.take() for _ in range(MAX_CHUNK_SLOTS)]
    assert arena.try_take() is None and arena.num_slots == MAX_CHUNK_SLOTS
    with pytest.raises(MemoryError, match="slot arena full"):
        arena.take()
    taken.pop()
    assert arena.try_take() is not None and arena.num_slots == MAX_CHUNK_SLOTS
    arena.close()


# --- disk


def test_disk_round_trip(tmp_path: Path):
    disk = DiskTier(tmp_path, 10 * FILE, NS)
    assert disk.put([(key(i), payload(i)) for i in range(3)]) == []
    assert disk.contains([key(0), key(1), key(2), key(3)]) == 3
    got = disk.get([key(0), key(3), key(2)])
    assert [None if p is None else bytes(p) for p in got] == [payload(0), None, payload(2)]
    assert disk.used_bytes == 3 * FILE and disk.stats.stored_blocks == 3 and disk.stats.written_bytes == 3 * BLOCK
    assert disk.stats.queries == 3 and disk.stats.hits == 2 and disk.stats.read_bytes == 2 * BLOCK
    assert disk.path(key(0)).is_file() and disk.path(key(0)).stat().st_size == FILE
    assert disk.put([(key(0), payload(0))]) == [] and disk.stats.stored_blocks == 3  # present: not rewritten


def test_disk_accepts_whole_blocks_only(tmp_path: Path):
    disk = DiskTier(tmp_path, 10 * FILE, NS)
    with pytest.raises(ValueError):
        disk.put([(key(0), payload(0, BLOCK - 1))])
    # a float32 buffer counts in bytes, not items
    disk.put([(key(1), memoryview(array("f", [1.0] * (BLOCK // 4))))])
    assert bytes(disk.get([key(1)])[0]) == array("f", [1.0] * (BLOCK // 4)).tobytes()


def test_disk_index_is_rebuilt_on_restart(tmp_path: Path):
    first = DiskTier(tmp_path, 10 * FILE, NS)
    first.put([(key(i), payload(i)) for i in range(4)])
    stale = first.path(key(0)).with_name(".leftover.123.456.tmp")
    stale.write_bytes(b"torn")
    os.utime(stale, (0, 0))  # left by a crash long ago
    for i in range(4):  # mtimes in an order unlike the keys': 2 oldest, then 0, 3, 1
        os.utime(first.path(key(i)), (100 + [1, 3, 0, 2][i], 100 + [1, 3, 0, 2][i]))
    second = DiskTier(tmp_path, 10 * FILE, NS)
    assert not stale.exists()
    assert second.contains([key(i) for i in range(4)]) == 4 and second.used_bytes == 4 * FILE
    assert [bytes(p) for p in second.get([key(i) for i in range(4)])] == [payload(i) for i in range(4)]
    # the oldest by mtime goes first when a smaller capacity is set
    third = DiskTier(tmp_path, 2 * FILE, NS)
    assert [third.contains([key(i)]) for i in range(4)] == [0, 1, 0, 1]
    assert not first.path(key(2)).exists() and not first.path(key(0)).exists()


def test_a_namespace_without_a_compute_dtype_keeps_its_digest():
    """compute_dtype is left out of the digest where unset (K/V computed in their own dtype): records stored
    before the field existed keep their keys."""
    digest = "8debd746"  # as main computed it before the field
    assert NS.digest.hex()[:8] == digest, NS.digest.hex()


@pytest.mark.parametrize(
    "other",
    [
        Namespace("other-weights", "float32", 4, (2, 2, 4, 1, 8)),
        Namespace("fp", "float16", 4, (2, 2, 4, 1, 16)),  # same bytes per block, another dtype
        Namespace("fp", "float32", 4, (2, 2, 4, 2, 4)),  # same bytes per block, another shape
        Namespace("fp", "float32", 4, (2, 2, 4, 1, 8), weight_dtype="bfloat16"),  # the weights rounded
        Namespace("fp", "bfloat16", 4, (2, 2, 4, 2, 8)),  # the same block in bf16 K/V
        Namespace("fp", "float32", 4, (2, 2, 4, 1, 8), compute_dtype="bfloat16"),  # K/V computed in bf16
    ],
)
def test_disk_of_another_namespace_sees_nothing(tmp_path: Path, other: Namespace):
    mine = DiskTier(tmp_path, 4 * FILE, NS)
    mine.put([(key(i), payload(i)) for i in range(3)])
    theirs = DiskTier(tmp_path, 1 * FILE, other)
    assert theirs.used_bytes == 0 and theirs.contains([key(0)]) == 0 and theirs.get([key(0)]) == [None]
    theirs.put([(key(5), payload(5, other.block_nbytes)), (key(6), payload(6, other.block_nbytes))])
    # their evictions and our restart leave each other's files alone
    again = DiskTier(tmp_path, 4 * FILE, NS)
    assert again.contains([key(0), key(1), key(2)]) == 3 and again.used_bytes == 3 * FILE
    assert again.contains([key(6)]) == 0


def test_disk_flipped_byte_is_a_counted_miss_and_the_file_goes(tmp_path: Path):
    disk = DiskTier(tmp_path, 10 * FILE, NS)
    disk.put([(key(0), payload(0)), (key(1), payload(1))])
    path = disk.path(key(0))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x10
    path.write_bytes(data)
    got = disk.get([key(0), key(1)])
    assert got[0] is None and bytes(got[1]) == payload(1)
    assert disk.stats.errors["corrupt"] == 1 and disk.stats.hits == 1
    assert not path.exists() and disk.contains([key(0)]) == 0 and disk.used_bytes == FILE
    assert disk.available  # a bad record is not an I/O fault


def test_disk_reads_into_recycled_slots_and_past_them_into_fresh_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(disk_module, "READ_ARENA_BYTES", (FILE + 1) * MAX_CHUNK_SLOTS)  # one mapping
    disk = DiskTier(tmp_path, (MAX_CHUNK_SLOTS + 10) * FILE, NS)
    n = MAX_CHUNK_SLOTS + 5
    disk.put([(key(i), payload(i)) for i in range(n)])
    arena = disk._read_arena
    got = disk.get([key(i) for i in range(n)])
    assert [bytes(p) for p in got] == [payload(i) for i in range(n)]
    assert all(arena.owns(p.obj) for p in got[:MAX_CHUNK_SLOTS]) and not any(arena.owns(p.obj) for p in got[-5:])
    assert arena.num_free == 0
    del got
    assert arena.num_free == arena.num_slots == MAX_CHUNK_SLOTS  # every slot back once the loads are dropped
    first = disk.get([key(0)])[0]
    assert bytes(first) == payload(0) and arena.num_free == MAX_CHUNK_SLOTS - 1


def test_disk_overlong_file_is_a_miss(tmp_path: Path):
    disk = DiskTier(tmp_path, 10 * FILE, NS)
    disk.put([(key(0), payload(0))])
    with open(disk.path(key(0)), "ab") as f:
        f.write(b"\0")
    assert disk.get([key(0)]) == [None] and disk.stats.errors["corrupt"] == 1
    assert disk._read_arena.num_free == disk._read_arena.num_slots  # the bad read's slot is back


def test_disk_truncated_file_is_a_miss(tmp_path: Path):
    disk = DiskTier(tmp_path, 10 * FILE, NS)
    disk.put([(key(0), payload(0))])
    with open(disk.path(key(0)), "r+b") as f:
        f.truncate(FILE - 10)
    assert disk.get([key(0)]) == [None] and disk.stats.errors["corrupt"] == 1


def test_disk_another_keys_record_under_this_name_is_a_miss(tmp_path: Path):
    disk = DiskTier(tmp_path, 10 * FILE, NS)
    disk.put([(key(0), payload(0)), (key(1), payload(1))])
    os.replace(disk.path(key(1)), disk.path(key(0)))
    assert disk.get([key(0)]) == [None] and disk.stats.errors["corrupt"] == 1
    assert disk.get([key(1)]) == [None] and disk.contains([key(1)]) == 0  # its file went away: a plain miss
    assert disk.stats.errors["corrupt"] == 1


def test_disk_capacity_evicts_the_oldest(tmp_path: Path):
    disk = DiskTier(tmp_path, 3 * FILE, NS)
    disk.put([(key(i), payload(i)) for i in range(3)])
    disk.get([key(0)])  # 0 recently used: 1 is now the oldest
    assert disk.put([(key(3), payload(3))]) == [(key(1), None)]  # deleted, not handed down: no payload
    assert [disk.contains([key(i)]) for i in range(4)] == [1, 0, 1, 1]
    assert not disk.path(key(1)).exists() and disk.used_bytes == 3 * FILE
    for i in range(4, 10):
        disk.put([(key(i), payload(i))])
        assert disk.used_bytes <= disk.capacity_bytes
    assert len(list(disk.directory.rglob("*.kv"))) == 3
    assert DiskTier(tmp_path, 10, NS).put([(key(20), payload(20))]) == []  # a block larger than the tier: dropped


def test_disk_fault_steps_aside_then_comes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    logging.getLogger("kvserve").addHandler(handler)
    try:
        check_fault_steps_aside_then_comes_back(tmp_path, monkeypatch)
    finally:
        logging.getLogger("kvserve").removeHandler(handler)
    assert len(warnings) == 2 and "No space left" in warnings[0].getMessage()  # once per episode of faults


def check_fault_steps_aside_then_comes_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    disk = DiskTier(tmp_path, 10 * FILE, NS, clock=clock)
    disk.put([(key(0), payload(0))])
    real_replace = os.replace

    def disk_full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    assert disk.put([(key(1), payload(1)), (key(2), payload(2))]) == []  # no exception
    assert disk.stats.errors["io"] == 1 and disk.stats.dropped_writes == 2 and not disk.available
    assert not list(disk.directory.rglob("*.tmp"))  # the partial file is cleaned up
    assert disk.contains([key(0)]) == 0 and disk.get([key(0)]) == [None]  # stepped aside: no I/O
    disk.put([(key(3), payload(3))])
    assert disk.stats.dropped_writes == 3 and disk.stats.errors["io"] == 1
    clock.now += 5.0  # the cooldown is over; the probe fails again, so the next cooldown is twice as long
    disk.put([(key(3), payload(3))])
    assert disk.stats.errors["io"] == 2 and not disk.available
    monkeypatch.setattr(os, "replace", real_replace)
    clock.now += 5.0
    assert not disk.available
    clock.now += 5.0
    assert disk.available
    disk.put([(key(3), payload(3))])  # a successful probe closes the breaker
    assert disk.available and disk.contains([key(0)]) == 1
    assert [bytes(p) for p in disk.get([key(0), key(3)])] == [payload(0), payload(3)]
    monkeypatch.setattr(os, "replace", disk_full)  # a new episode warns again
    disk.put([(key(4), payload(4))])
    assert disk.stats.errors["io"] == 3 and not disk.available


def test_tiers_under_concurrent_use(tmp_path: Path):
    host, disk = HostTier(capacity_bytes=8 * BLOCK), DiskTier(tmp_path, 8 * FILE, NS)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for n in range(60):
                ids = [(seed * 7 + n * 3 + j) % 20 for j in range(3)]
                for tier in (host, disk):
                    tier.put([(key(i), payload(i)) for i in ids])
                    for i, got in zip(ids, tier.get([key(i) for i in ids]), strict=True):
                        assert got is None or bytes(got) == payload(i)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert host.used_bytes <= host.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
    assert host.used_bytes == len(host) * BLOCK and disk.used_bytes == len(disk) * FILE
    assert not list(tmp_path.rglob("*.tmp")) and disk.available and disk.stats.errors == {}


def test_disk_read_fault_steps_aside(tmp_path: Path):
    clock = FakeClock()
    disk = DiskTier(tmp_path, 10 * FILE, NS, clock=clock)
    disk.put([(key(0), payload(0))])
    path = disk.path(key(0))
    path.unlink()
    path.mkdir()  # reading it is an I/O error other than "not found"
    assert disk.get([key(0)]) == [None] and disk.stats.errors["io"] == 1 and not disk.available
    path.rmdir()
    clock.now += 5.0
    assert disk.get([key(0)]) == [None] and disk.available  # the probe: a plain miss, the disk works


def test_disk_directory_that_cannot_be_created_starts_aside(tmp_path: Path):
    clock = FakeClock()
    blocker = tmp_path / "cache"
    blocker.write_bytes(b"a file where the directory should be")
    disk = DiskTier(blocker, 10 * FILE, NS, clock=clock)
    assert not disk.available and disk.stats.errors["io"] == 1
    assert disk.put([(key(0), payload(0))]) == [] and disk.stats.dropped_writes == 1
    blocker.unlink()
    clock.now += 5.0
    disk.put([(key(0), payload(0))])
    assert disk.available and bytes(disk.get([key(0)])[0]) == payload(0)


def test_disk_files_reveal_neither_salt_nor_tokens(tmp_path: Path):
    salt = "tenant-secret-salt-42"
    tokens = [7, 123456, 987654321, 31337, 424242, 5, 6, 8]
    keys = [tier_key(NS.digest, k) for k in chain_keys(b"", tokens, NS.block_size, extra_key(salt))]
    disk = DiskTier(tmp_path, 10 * FILE, NS)
    disk.put([(k, os.urandom(BLOCK)) for k in keys])
    needles = [salt.encode(), extra_key(salt), array("q", tokens[:4]).tobytes()] + [
        struct.pack("<q", t) for t in tokens[1:5]
    ]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == len(keys) == 2
    for path in files:
        name, data = str(path.relative_to(tmp_path)).encode(), path.read_bytes()
        for needle in needles:
            assert needle not in data and needle.hex().encode() not in name and needle not in name


# --- records


def test_record_round_trip_and_every_field_is_checked():
    k, body = key(0), payload(0)
    good = record.encode(NS, k, body)
    assert bytes(record.decode(NS, k, good)) == body
    assert record.header(NS, k, body) + body == good and len(good) == FILE

    def patched(offset: int, value: bytes) -> bytes:
        return good[:offset] + value + good[offset + len(value) :]

    ndim = len(NS.block_shape)
    shape_at, tail_at = 4 + 2 + 1 + 1 + 32 + 32, 4 + 2 + 1 + 1 + 32 + 32 + 4 * ndim
    bad = {
        "magic": patched(0, b"XXXX"),
        "version": patched(4, struct.pack("<H", 99)),
        "dtype": patched(6, bytes([3])),
        "ndim": patched(7, bytes([ndim + 1])),
        "namespace": patched(8, bytes(32)),
        "key": patched(40, key(1)),
        "shape": patched(shape_at, struct.pack("<I", 3)),
        "length": patched(tail_at, struct.pack("<Q", BLOCK + 4)),
        "checksum": patched(tail_at + 8, struct.pack("<Q", xxhash.xxh3_64_intdigest(body) ^ 1)),
        "payload": patched(FILE - 1, bytes([good[-1] ^ 1])),
        "truncated payload": good[:-1],
        "overlong payload": good + b"\0",
        "truncated header": good[:20],
    }
    for what, data in bad.items():
        with pytest.raises(record.BadRecord):
            record.decode(NS, k, data)
        assert what  # names the case in a failure's traceback
    with pytest.raises(record.BadRecord, match="key"):
        record.decode(NS, key(1), good)
    with pytest.raises(record.BadRecord, match="namespace"):
        record.decode(Namespace("other", "float32", 4, (2, 2, 4, 1, 8)), k, good)
