"""The tiers below the device pool as one store: what to save where, and loads off the step loop.

Saving. Blocks move down: evicted from the device pool, a block goes to the first local
tier (host RAM, else disk); evicted from host RAM, to disk (`write_back`, SGLang's
default). With `write_through`, every block is written to every local tier as it fills.
A shared tier (Redis) is written as blocks fill whatever the policy, so other replicas
can use them at once. Host RAM is written in the engine's thread (a dict insert); disk
and Redis by one writer thread through a bounded queue: when it is full, writes are
dropped (counted), never waited for.

Loading. `start_load` plans from the local tiers' in-memory indexes; a run served by
host RAM alone is read at once, anything needing disk or Redis (one batched read per
tier) runs on a loader thread while the request waits and others run. A block found
nowhere ends the run: only a contiguous prefix is useful.

Events. With `on_events`, blocks entering and leaving the local tiers are announced as KV
events (medium "CPU" for host RAM, "STORAGE" for disk), from the engine's thread for host
RAM and from the writer's for disk. Redis is shared by every replica, so it says nothing
about where to route: its blocks are not announced.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from enum import StrEnum

from kvserve.kv_cache.events import DISK, HOST, BlockRemoved, BlockStored, KVCacheEvent
from kvserve.kv_cache.tiers.base import SHARED_TIERS, KVTier, ShardSnapshot
from kvserve.kv_cache.tiers.host import HostTier
from kvserve.kv_cache.tiers.namespace import Namespace, tier_key
from kvserve.logger import logger

Payload = bytes | memoryview
EventSink = Callable[[list[KVCacheEvent]], object]  # called from the engine's and the writer's threads
# seconds; a load from RAM takes microseconds, from disk or Redis on loopback milliseconds
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class WritePolicy(StrEnum):
    WRITE_BACK = "write_back"  # a block goes down a tier when evicted from the one above
    WRITE_THROUGH = "write_through"  # every local tier gets a block as it fills


@dataclass
class LoadHistogram:
    """Cumulative counts per bucket of `LOAD_BUCKETS` (then +Inf), as Prometheus wants them."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(LOAD_BUCKETS) if seconds <= b), len(LOAD_BUCKETS))
        self.counts[i] += 1
        self.total += seconds


@dataclass
class TierUse:
    """Per tier, in blocks: looked up at admission, and served to a request."""

    queried: int = 0
    served: int = 0
    load_seconds: LoadHistogram = field(default_factory=LoadHistogram)


@dataclass(frozen=True)
class TierSnapshot:
    """One tier's counters at one moment, for /metrics and the engine stats."""

    name: str
    queried_blocks: int
    served_blocks: int  # blocks this tier delivered into the device pool
    read_bytes: int
    written_bytes: int
    stored_blocks: int
    dropped_writes: int
    used_bytes: int
    capacity_bytes: int | None
    errors: dict[str, int]
    breaker_state: int  # BreakerState: 0 closed, 1 open, 2 half-open
    load_seconds: LoadHistogram
    shards: tuple[ShardSnapshot, ...] = ()  # a Redis Cluster's masters; none for the other tiers


@dataclass
class KVLoad:
    """One request's load: the blocks after its device-pool hit, from `first_block` on."""

    first_block: int
    deadline: float
    future: Future[list[tuple[str, Payload]]] | None = None
    result: list[tuple[str, Payload]] | None = None  # (tier name, payload) per block, in order

    @property
    def done(self) -> bool:
        return self.result is not None or self.future is None or self.future.done()

    def payloads(self) -> list[tuple[str, Payload]]:
        """What arrived ([] if the load failed or timed out)."""
        if self.result is None and self.future is not None and self.future.done():
            self.result = self.future.result() if self.future.exception() is None else []
        return self.result or []


Names = dict[bytes, bytes]  # tier key -> block key, for the blocks of one save
AfterPut = Callable[[KVTier, list[tuple[bytes, Payload]], list[tuple[bytes, object]], Names], object]


class _TierEvents:
    """BlockStored / BlockRemoved as blocks enter and leave the local tiers, from any thread.

    A tier key is a digest of its block key (no way back), so this keeps the block key of
    every tier key a local tier holds: bounded by the tiers' contents.
    """

    MEDIA = {"host": HOST, "disk": DISK}

    def __init__(self, block_size: int, sink: EventSink):
        self.block_size, self.sink = block_size, sink
        self._held: dict[str, dict[bytes, bytes]] = {name: {} for name in self.MEDIA}  # tier key -> block key
        self._lock = threading.Lock()

    def after_put(
        self, tier: KVTier, items: list[tuple[bytes, Payload]], evicted: list[tuple[bytes, object]], names: Names
    ) -> Names:
        """Announce what `tier.put(items)` stored and evicted; returns the evicted blocks' keys."""
        held, out = self._held[tier.name], [k for k, _ in evicted]
        with self._lock:
            fresh = [k for k in dict.fromkeys(k for k, _ in items) if k not in held and k in names]
        stored = [k for k in fresh if k in out or tier.contains([k])]  # some puts are dropped
        with self._lock:
            held.update((k, names[k]) for k in stored)
            gone = {k: held.pop(k) for k in out if k in held}
        medium = self.MEDIA[tier.name]
        events: list[KVCacheEvent] = []
        if stored:  # no parent: a tier takes blocks in eviction order, not in chains
            events.append(BlockStored([names[k] for k in stored], None, [], self.block_size, medium=medium))
        if gone:
            events.append(BlockRemoved(list(gone.values()), medium=medium))
        if events:
            self.sink(events)
        return gone

    def announce_held(self) -> None:
        """Every block the local tiers hold, as BlockStored (after an AllBlocksCleared)."""
        with self._lock:
            held = {name: list(keys.values()) for name, keys in self._held.items()}
        events: list[KVCacheEvent] = [
            BlockStored(keys, None, [], self.block_size, medium=self.MEDIA[name]) for name, keys in held.items() if keys
        ]
        if events:
            self.sink(events)


class _Writer:
    """One thread writing batches to the slow tiers, fed by a bounded queue."""

    def __init__(self, max_batches: int, after_put: AfterPut | None = None):
        self.queue: queue.Queue[tuple[KVTier, list[tuple[bytes, Payload]], Names | None] | None] = queue.Queue(
            max_batches
        )
        self.after_put = after_put
        self.thread = threading.Thread(target=self._run, name="kvserve-kv-writer", daemon=True)
        self.thread.start()

    def submit(self, tier: KVTier, items: list[tuple[bytes, Payload]], names: Names | None = None) -> None:
        try:
            self.queue.put_nowait((tier, items, names))
        except queue.Full:
            tier.stats.add(dropped_writes=len(items))

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            tier, items, names = job
            try:
                evicted = tier.put(items)
                if self.after_put is not None and names is not None:
                    self.after_put(tier, items, evicted, names)
            except Exception:  # a tier bug must not kill the writer; the blocks just aren't stored
                logger.exception("KV tier %s failed a write", tier.name)
            finally:
                self.queue.task_done()

    def flush(self) -> None:
        self.queue.join()

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=5)


class TieredKVStore:
    def __init__(
        self,
        namespace: Namespace,
        tiers: Sequence[KVTier],
        write_policy: WritePolicy = WritePolicy.WRITE_BACK,
        load_timeout: float = 2.0,
        max_queued_writes: int = 64,
        on_events: EventSink | None = None,
    ):
        self.namespace = namespace
        self.tiers = list(tiers)
        self.local = [t for t in tiers if t.name in ("host", "disk")]
        self.shared = [t for t in tiers if t.name in SHARED_TIERS]
        # blocks pulled from a prefill replica: looked up first, never written to by the store
        self.handoff = next((t for t in tiers if t.name == "handoff"), None)
        self.write_policy = WritePolicy(write_policy)
        self.load_timeout = load_timeout
        self.use = {t.name: TierUse() for t in tiers}
        self.errors: Counter[str] = Counter()  # the store's own: load timeouts
        self._shared_known: OrderedDict[bytes, None] = OrderedDict()  # keys a shared tier holds (bounded)
        self._lock = threading.Lock()  # _shared_known: the loader thread adds to it too
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-load")
        self.events = _TierEvents(namespace.block_size, on_events) if on_events is not None else None
        self._writer = _Writer(max_queued_writes, self.events.after_put if self.events is not None else None)

    @property
    def saves_on_fill(self) -> bool:
        return bool(self.shared) or (self.write_policy is WritePolicy.WRITE_THROUGH and bool(self.local))

    @property
    def saves_on_evict(self) -> bool:
        return self.write_policy is WritePolicy.WRITE_BACK and bool(self.local)

    def keys(self, block_keys: Sequence[bytes]) -> list[bytes]:
        return [tier_key(self.namespace.digest, k) for k in block_keys]

    # saving

    def wanted(self, block_keys: Sequence[bytes], filled: bool) -> list[bool]:
        """Which of these blocks a save would store anywhere (the rest need not be read out)."""
        keys = self.keys(block_keys)
        if filled:
            local = self.write_policy is WritePolicy.WRITE_THROUGH and self.local
            return [bool(local) or (bool(self.shared) and k not in self._shared_known) for k in keys]
        return [not any(t.contains([k]) for t in self.local) for k in keys]

    def put_handoff(self, block_keys: Sequence[bytes], payloads: Sequence[Payload]) -> None:
        """Blocks pulled from a prefill replica, for the next lookup of their prefix."""
        if self.handoff is not None:
            self.handoff.put(list(zip(self.keys(block_keys), payloads, strict=True)))

    def payload_buffers(self, n: int) -> list[memoryview] | None:
        """n writable block buffers to gather a save into: host RAM's, which it keeps without a
        copy (the other tiers only read them); None where no tier has any."""
        host = next((t for t in self.local if isinstance(t, HostTier)), None)
        return None if host is None else host.buffers(n)

    def save(
        self,
        block_keys: Sequence[bytes],
        payloads: Sequence[Payload],
        filled: bool,
        announced: Sequence[bytes] | None = None,
    ) -> None:
        """Blocks just filled (`filled`) or just evicted from the device pool; with events,
        those of `announced` (default: all) are announced as they enter and leave a tier."""
        items = list(zip(self.keys(block_keys), payloads, strict=True))
        # only with events: which block each tier key stands for (a tier key is a one-way digest)
        names = None
        if self.events is not None:
            shown = set(block_keys if announced is None else announced)
            names = {k: b for (k, _), b in zip(items, block_keys, strict=True) if b in shown}
        if filled:
            if self.write_policy is WritePolicy.WRITE_THROUGH:
                for tier in self.local:
                    self._put(tier, items, names)
            fresh = [(k, p) for k, p in items if k not in self._shared_known]
            for tier in self.shared:
                self._put(tier, fresh)
            self._remember_shared(k for k, _ in fresh)
        elif self.write_policy is WritePolicy.WRITE_BACK and self.local:
            self._put_down(0, items, names)

    def _put_down(self, level: int, items: list[tuple[bytes, Payload]], names: Names | None) -> None:
        """Write to local tier `level`; what it evicts goes to the next one (write-back)."""
        if level >= len(self.local) or not items:
            return
        evicted = self._put(self.local[level], items, names)
        if self.write_policy is WritePolicy.WRITE_BACK:
            self._put_down(level + 1, evicted, names)

    def _put(
        self, tier: KVTier, items: list[tuple[bytes, Payload]], names: Names | None = None
    ) -> list[tuple[bytes, Payload]]:
        if not items:
            return []
        if tier.name == "host":  # in-memory: cheaper done here than queued
            evicted = tier.put(items)
            if self.events is not None and names is not None:
                names.update(self.events.after_put(tier, items, evicted, names))  # they may go down a tier
            return evicted
        self._writer.submit(tier, items, dict(names) if names is not None else None)
        return []

    def _remember_shared(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._shared_known[k] = None
                self._shared_known.move_to_end(k)
            while len(self._shared_known) > 1 << 16:
                self._shared_known.popitem(last=False)

    # loading

    def start_load(self, block_keys: Sequence[bytes], first_block: int) -> KVLoad | None:
        """Look up a request's blocks after its device hit (`block_keys` are those blocks');
        None when no tier can have any."""
        if not block_keys:
            return None
        keys = self.keys(block_keys)
        plan, end = self._plan_local(keys)
        for tier in self.tiers:
            self.use[tier.name].queried += len(keys)
        deadline = time.monotonic() + self.load_timeout
        if not self.shared or end == len(keys):
            if not plan:
                return None
            if all(t.name in ("host", "handoff") for t, _, _ in plan):
                return KVLoad(first_block, deadline, result=self._load(keys, plan, remote=False))
        return KVLoad(first_block, deadline, future=self._loader.submit(self._load, keys, plan, bool(self.shared)))

    def _plan_local(self, keys: list[bytes]) -> tuple[list[tuple[KVTier, int, int]], int]:
        """Runs of keys each served by one local tier, from their in-memory indexes."""
        plan, pos = [], 0
        local = self.local if self.handoff is None else [self.handoff, *self.local]
        while pos < len(keys):
            for tier in local:
                n = tier.contains(keys[pos:])
                if n:
                    plan.append((tier, pos, pos + n))
                    pos += n
                    break
            else:
                break
        return plan, pos

    def _load(self, keys: list[bytes], plan: list[tuple[KVTier, int, int]], remote: bool) -> list[tuple[str, Payload]]:
        out: list[tuple[str, Payload]] = []
        for tier, start, end in plan:
            if not self._read(tier, keys[start:end], out):
                return out
        if remote and len(out) < len(keys):
            for tier in self.shared:
                if not self._read(tier, keys[len(out) :], out) or len(out) == len(keys):
                    break
        return out

    def _read(self, tier: KVTier, keys: list[bytes], out: list[tuple[str, Payload]]) -> bool:
        """Append the leading payloads `tier` returns; False if it had fewer than asked."""
        start = time.perf_counter()
        payloads = tier.get(keys)
        self.use[tier.name].load_seconds.observe(time.perf_counter() - start)
        n = 0
        for p in payloads:
            if p is None:
                break
            out.append((tier.name, p))
            n += 1
        if tier in self.shared:
            self._remember_shared(keys[:n])
        return n == len(keys)

    @staticmethod
    def wait_for_loads(loads: Iterable[KVLoad], timeout: float) -> None:
        """Block until one of these loads finishes, or `timeout` seconds."""
        futures = [load.future for load in loads if load.future is not None]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
        else:
            time.sleep(timeout)

    def record_served(self, served: list[tuple[str, Payload]]) -> None:
        for name, _ in served:
            self.use[name].served += 1

    def record_timeout(self) -> None:
        self.errors["load_timeout"] += 1

    def snapshot(self) -> list[TierSnapshot]:
        """Safe from any thread: counters only (Redis's usage is its own cached INFO)."""
        snaps = []
        for tier in self.tiers:
            use, st = self.use[tier.name], tier.stats
            state = tier.breaker_state
            errors = dict(st.errors) | ({"load_timeout": self.errors["load_timeout"]} if tier in self.shared else {})
            hist = LoadHistogram(list(use.load_seconds.counts), use.load_seconds.total)
            snaps.append(
                TierSnapshot(
                    tier.name, use.queried, use.served, st.read_bytes, st.written_bytes, st.stored_blocks,
                    st.dropped_writes, tier.used_bytes, tier.capacity_bytes, errors, int(state), hist,
                    tuple(tier.shards()),
                )
            )  # fmt: skip
        return snaps

    def announce_held(self) -> None:
        """With events: announce again what the local tiers hold (the device pool was just cleared)."""
        if self.events is not None:
            self.events.announce_held()

    def flush(self) -> None:
        """Wait for queued writes (tests, benchmarks and shutdown)."""
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
        self._loader.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            tier.close()
