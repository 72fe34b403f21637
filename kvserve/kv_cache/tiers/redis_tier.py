"""Redis: the tier every replica shares, below host RAM and disk.

Each block is one Redis string, key `kvserve:kv:<tier key hex>`, value a checked record
(record.py), written with one SET, so a reader sees a whole record or none. The tier
key is already a digest of the namespace and the chained block key, so neither a token
id nor a tenant's salt reaches the server. Reads check every record: a bad one (torn,
flipped, another model's or dtype's) is a miss, counted as "corrupt" and deleted.

Redis bounds itself: give the server a `maxmemory` and `maxmemory-policy allkeys-lru`,
so old blocks make room for new ones (EXISTS does not refresh recency, MGET does). A
`ttl` expires blocks besides that. `put` evicts nothing for the tier below.

A failing server costs one bounded timeout per call (no retries), then the circuit
breaker steps the tier aside: calls are misses at no cost until a probe succeeds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.kv_cache.tiers.base import KVTier
from kvserve.kv_cache.tiers.breaker import BreakerState, CircuitBreaker
from kvserve.kv_cache.tiers.namespace import Namespace
from kvserve.kv_cache.tiers.record import BadRecord, decode, encode
from kvserve.logger import logger

KEY_PREFIX = b"kvserve:kv:"
TIER_KEY_BYTES = 32
INFO_MAX_AGE = 5.0  # seconds the server's memory figures are reused: metrics read them often
# idle connections are PINGed before reuse after this long, so one dropped by the server
# (its `timeout`, a restart) is replaced before a call fails on it
HEALTH_CHECK_INTERVAL = 15

T = TypeVar("T")
_FAULTS = (redis.exceptions.RedisError, OSError)  # OSError covers socket.timeout and refused connects
_MISS = object()  # the breaker refused the call, or it failed


def redis_key(key: bytes) -> bytes:
    """The Redis key of tier key `key`: nothing but a fixed prefix and the digest."""
    if len(key) != TIER_KEY_BYTES:
        raise ValueError(f"a tier key is {TIER_KEY_BYTES} bytes, got {len(key)}")
    return KEY_PREFIX + key.hex().encode()


def check_record(
    ns: Namespace, key: bytes, name: bytes, value: bytes | None, bad: list[bytes], where: str
) -> memoryview | None:
    """The payload of Redis value `value`, or None where it is missing or bad (then `name` goes in `bad`)."""
    if value is None:
        return None
    try:
        return decode(ns, key, value)
    except BadRecord as exc:
        logger.debug("Redis tier %s: bad record %s (%s); deleting it", where, name.decode(), exc)
        bad.append(name)
        return None


def error_kind(exc: BaseException) -> str:
    # redis-py's TimeoutError and ConnectionError are not the builtins, so test both
    if isinstance(exc, redis.exceptions.TimeoutError | TimeoutError):
        return "timeout"
    if isinstance(exc, redis.exceptions.ConnectionError | ConnectionError):
        return "connection"  # includes refused, reset, and AUTH failures
    return "other"


MemoryFigures = tuple[int, int | None]  # used_memory, maxmemory (None: unbounded)


class MemoryInfo:
    """A Redis deployment's memory figures, asked at most every INFO_MAX_AGE seconds (/metrics and
    the dashboard read them often); a failed ask (`fetch` returns None) keeps the last ones known,
    still the best estimate."""

    def __init__(self, fetch: Callable[[], MemoryFigures | None]):
        self._fetch = fetch
        self._lock = threading.Lock()
        self._figures: MemoryFigures = (0, None)
        self._expires = 0.0

    def get(self) -> MemoryFigures:
        now = time.monotonic()
        with self._lock:
            if now < self._expires:
                return self._figures
            self._expires = now + INFO_MAX_AGE  # claimed: concurrent readers keep the last figures
        figures = self._fetch()
        if figures is not None:
            with self._lock:
                self._figures = figures
        return self._figures


class RedisTier(KVTier):
    name = "redis"

    def __init__(
        self,
        url: str,
        namespace: Namespace,
        *,
        socket_timeout: float = 0.5,
        connect_timeout: float = 0.25,
        breaker: CircuitBreaker | None = None,
        ttl: float | None = None,
    ) -> None:
        """`url`: redis://[[user]:password@]host:port/db, or rediss:// for TLS. `ttl`: seconds a
        block lives (None: until Redis evicts it)."""
        super().__init__()
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds or None, got {ttl}")
        self.namespace = namespace
        self.breaker = breaker or CircuitBreaker(failure_threshold=3, cooldown=1.0, max_cooldown=30.0)
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry_on_timeout=False,
            # redis-py retries connection errors and timeouts by default (3 times, with backoff);
            # a cache would rather miss at once, and the breaker handles a server that stays down
            retry=Retry(NoBackoff(), 0),
            health_check_interval=HEALTH_CHECK_INTERVAL,
        )
        self._where = _describe(self._client)  # for logs: never the URL, which may hold a password
        self._lock = threading.Lock()
        self._stepped_aside = False  # what the last transition logged, so each is logged once
        self._memory = MemoryInfo(self._fetch_memory)

    def contains(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        names = [redis_key(k) for k in keys]

        def op() -> list[int]:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        found = self._run(op)
        if found is _MISS:
            return 0
        n = 0
        for present in found:
            if not present:
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        if not keys:
            return []
        names = [redis_key(k) for k in keys]
        values = self._run(lambda: self._client.mget(names))
        if values is _MISS:
            self.stats.add(queries=len(keys))
            return [None] * len(keys)
        out: list[bytes | memoryview | None] = []
        bad: list[bytes] = []
        for key, name, value in zip(keys, names, values, strict=True):
            out.append(check_record(self.namespace, key, name, value, bad, self._where))
        found = [p for p in out if p is not None]
        self.stats.add(queries=len(keys), hits=len(found), read_bytes=sum(len(p) for p in found))
        if bad:
            self.stats.error("corrupt", len(bad))
            # best effort; another replica may have just rewritten the key with a good record,
            # which this deletes: a later miss, never a wrong block
            self._run(lambda: self._client.delete(*bad))
        return out

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[tuple[bytes, bytes | memoryview]]:
        if not items:
            return []
        names = [redis_key(k) for k, _ in items]
        payloads = [memoryview(p).cast("B") for _, p in items]  # counts bytes, whatever the buffer's format

        def op() -> None:
            # encoded here, not before: a refused call should not pay for the checksums
            pipe = self._client.pipeline(transaction=False)
            for name, (key, _), payload in zip(names, items, payloads, strict=True):
                pipe.set(name, encode(self.namespace, key, payload), px=self._ttl_ms)
            pipe.execute()

        if self._run(op) is _MISS:
            self.stats.add(dropped_writes=len(items))
        else:
            self.stats.add(stored_blocks=len(items), written_bytes=sum(p.nbytes for p in payloads))
        return []  # Redis makes room by itself (maxmemory-policy): nothing comes back for a tier below

    @property
    def used_bytes(self) -> int:
        """The server's `used_memory` (all its data, every replica's blocks; 0 until known): what
        this process wrote and nobody evicted is not knowable here."""
        return self._memory.get()[0]

    @property
    def capacity_bytes(self) -> int | None:
        """The server's `maxmemory`; None where it has none (or it is not known yet)."""
        return self._memory.get()[1]

    @property
    def breaker_state(self) -> BreakerState:
        return self.breaker.state

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()

    def _fetch_memory(self) -> MemoryFigures | None:
        info = self._run(lambda: self._client.info("memory"))
        return None if info is _MISS else (int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)) or None)

    def _run(self, op: Callable[[], T]) -> T | object:
        """`op()`, or _MISS where the breaker refuses (no socket touched) or the call fails."""
        if not self.breaker.allow():
            return _MISS
        try:
            result = op()
        except _FAULTS as exc:
            self._failed(exc)
            return _MISS
        except BaseException as exc:
            # not a tier fault (a bug, an interrupt), but the breaker may have let this call
            # through as its one half-open probe: report it, or the breaker stays open for good
            self._failed(exc)
            raise
        self._succeeded()
        return result

    def _succeeded(self) -> None:
        with self._lock:  # the breaker's transition and ours together, so each is logged once
            self.breaker.success()
            came_back, self._stepped_aside = self._stepped_aside, False
        if came_back:
            logger.info("Redis tier %s: reachable again; serving blocks", self._where)

    def _failed(self, exc: BaseException) -> None:
        kind = error_kind(exc)
        self.stats.error(kind)
        with self._lock:
            self.breaker.failure()
            opened = not self._stepped_aside and self.breaker.state != BreakerState.CLOSED
            self._stepped_aside = self._stepped_aside or opened
        if opened:
            logger.warning(
                "Redis tier %s: stepping aside after %d failed calls in a row (last: %s, %s: %s); "
                "lookups miss and writes are dropped until a retry in %.1f s (or later) succeeds",
                self._where,
                self.breaker.failure_threshold,
                kind,
                type(exc).__name__,
                exc,
                self.breaker.cooldown,
            )


def _describe(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}"
    return f"{where}/{kwargs.get('db', 0)}"
