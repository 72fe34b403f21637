"""The interface every KV tier implements, and the counters it keeps."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.kv_cache.tiers.breaker import BreakerState

SHARED_TIERS = ("redis", "redis-cluster")  # the tiers replicas share (a P/D handoff can go through them)


@dataclass
class TierStats:
    """Cumulative, per tier; blocks and bytes (the store turns blocks into tokens)."""

    queries: int = 0  # blocks looked up
    hits: int = 0  # of those, found (and, for `get`, read back intact)
    read_bytes: int = 0
    written_bytes: int = 0
    stored_blocks: int = 0  # puts accepted
    dropped_writes: int = 0  # puts not done: tier stepped aside, queue full, or too large
    errors: Counter[str] = field(default_factory=Counter)  # by kind: "io", "timeout", "connection", "corrupt", ...
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def error(self, kind: str, n: int = 1) -> None:
        with self.lock:
            self.errors[kind] += n


@dataclass(frozen=True)
class ShardSnapshot:
    """One shard of a sharded tier (Redis Cluster: one master), for /metrics and the dashboard."""

    name: str  # the master's host:port
    queries: int  # blocks looked up there
    hits: int
    read_bytes: int
    written_bytes: int
    errors: dict[str, int]
    breaker_state: int  # BreakerState


class KVTier(ABC):
    """One tier. Methods are called from worker threads, so implementations are thread-safe.

    No method raises because the tier failed: a failure is a miss (or a dropped write),
    counted in `stats.errors`; a tier that keeps failing steps aside (`available` False)
    and comes back by itself.
    """

    name: str  # "host" | "disk" | "redis" | "redis-cluster" | "handoff"

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the tier holds (one round trip at most)."""

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """The payloads of `keys` (one round trip at most); None where missing or bad.

        A bad record (wrong magic, version, namespace, key, dtype, shape, length or
        checksum) is a miss: counted as a "corrupt" error and deleted."""

    @abstractmethod
    def put(
        self, items: Sequence[tuple[bytes, bytes | memoryview]]
    ) -> list[tuple[bytes, bytes | memoryview]] | list[tuple[bytes, None]]:
        """Store (key, payload) pairs; returns the pairs evicted to make room, for the tier below
        (payload None from a tier that deletes what it evicts: the last local one, disk)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """None where the tier does not bound itself (Redis: its own maxmemory)."""

    @property
    def breaker_state(self) -> BreakerState:
        """Its circuit breaker's state, as /metrics reports it (closed for a tier without one)."""
        return BreakerState.CLOSED

    @property
    def available(self) -> bool:
        """False while the tier has stepped aside after errors (circuit breaker open)."""
        return self.breaker_state == BreakerState.CLOSED

    def shards(self) -> list[ShardSnapshot]:
        """Per shard, for a tier spread over several (none for the others)."""
        return []

    def close(self) -> None:  # noqa: B027  (most tiers hold nothing to release)
        """Release connections and threads."""
