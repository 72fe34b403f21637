"""Redis Cluster (or Valkey Cluster): the shared tier spread over shards.

Records and keys are the single-node tier's (redis_tier.py): one key per block, no hash tag,
so blocks spread over the 16,384 slots by their digests and one prompt's blocks over every
shard. redis-py's `RedisCluster` finds the shards from any seed node and keeps the slot map;
a call groups its keys by the master of their slot and sends each shard one pipeline (one
round trip per shard, not per block: MGET cannot span slots). A MOVED or ASK reply is followed
once (ASKING, then the command, at the node it names), and asks for a refresh of the slot map.

Faults are misses, per shard: each master has its own circuit breaker, so a dead shard costs
one bounded timeout per call until its breaker opens, then its keys miss at no cost while the
other shards serve theirs. A failed shard or a redirect refreshes the slot map (at most once a
second), so a replica promoted by a failover is found and the master it replaced is forgotten.
A cluster unreachable when the tier is first used is a miss too: discovery is retried under a
breaker of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, RedisClusterException
from redis.retry import Retry

from kvserve.kv_cache.tiers.base import KVTier, ShardSnapshot, TierStats
from kvserve.kv_cache.tiers.breaker import BreakerState, CircuitBreaker
from kvserve.kv_cache.tiers.namespace import Namespace
from kvserve.kv_cache.tiers.record import encode
from kvserve.kv_cache.tiers.redis_tier import (
    HEALTH_CHECK_INTERVAL,
    MemoryFigures,
    MemoryInfo,
    check_record,
    error_kind,
    redis_key,
)
from kvserve.logger import logger

SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS
REFRESH_INTERVAL = 1.0  # seconds between slot-map refreshes a fault or a redirect asks for
MAX_PARALLEL_SHARDS = 8  # threads sending one call's pipelines; more shards queue for them
_FAULTS = (redis.exceptions.RedisError, RedisClusterException, OSError)
_MISS = object()  # a key whose shard refused, failed or redirected it twice
Command = tuple[object, ...]
_Group = tuple[ClusterNode, list[int]]  # a master and the indexes of the keys it serves


@dataclass(frozen=True)
class ClusterURL:
    nodes: tuple[tuple[str, int], ...]  # the seeds: any node of the cluster will do
    username: str | None
    password: str | None
    ssl: bool


def parse_cluster_url(url: str) -> ClusterURL:
    """redis+cluster://[user:password@]host:port[,host:port...] (rediss+cluster:// for TLS)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"a cluster URL starts with redis+cluster:// or rediss+cluster://, got {scheme!r}")
    auth, _, hosts = rest.rpartition("@")
    hosts = hosts.removesuffix("/").removesuffix("/0")  # a cluster has only database 0
    nodes = tuple(_host_port(h) for h in hosts.split(","))
    user, _, password = auth.partition(":") if auth else ("", "", "")
    return ClusterURL(nodes, unquote(user) or None, unquote(password) if auth else None, SCHEMES[scheme])


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or "/" in text:
        raise ValueError(f"a cluster seed is host:port, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass
class _Shard:
    """One master: its breaker and counters (name host:port, the `shard` label)."""

    name: str
    breaker: CircuitBreaker
    stats: TierStats
    stepped_aside: bool = False  # what the last transition logged, so each is logged once


class RedisClusterTier(KVTier):
    name = "redis-cluster"

    def __init__(
        self,
        url: str,
        namespace: Namespace,
        *,
        socket_timeout: float = 0.5,
        connect_timeout: float = 0.25,
        ttl: float | None = None,
        breaker: Callable[[], CircuitBreaker] | None = None,
    ) -> None:
        """`breaker`: makes each shard's breaker (and discovery's); `ttl`: seconds a block lives."""
        super().__init__()
        if ttl is not None and ttl <= 0:
            raise ValueError(f"ttl must be > 0 seconds or None, got {ttl}")
        self.namespace = namespace
        self._url = parse_cluster_url(url)
        self._timeouts = (socket_timeout, connect_timeout)
        self._new_breaker = breaker or (lambda: CircuitBreaker(failure_threshold=3, cooldown=1.0, max_cooldown=30.0))
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))
        self._where = ",".join(f"{h}:{p}" for h, p in self._url.nodes)  # for logs: never the password
        self._discovery = self._new_breaker()
        self._undiscovered = False  # logged that no seed answers
        self._cluster: RedisCluster | None = None  # connected on first use
        self._shards: dict[str, _Shard] = {}
        self._lock = threading.Lock()
        self._refresh_due = 0.0
        self._pool = ThreadPoolExecutor(MAX_PARALLEL_SHARDS, thread_name_prefix="kvserve-kv-shard")
        self._memory = MemoryInfo(self._fetch_memory)

    # the KVTier interface

    def contains(self, keys: Sequence[bytes]) -> int:
        replies = self._run([redis_key(k) for k in keys], lambda name: ("EXISTS", name))
        n = 0
        for present in replies:
            if present is _MISS or not present:
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        names = [redis_key(k) for k in keys]
        shards: list[_Shard | None] = [None] * len(names)
        replies = self._run(names, lambda name: ("GET", name), shards)
        out: list[bytes | memoryview | None] = []
        bad: list[bytes] = []
        for key, name, value, shard in zip(keys, names, replies, shards, strict=True):
            payload = None if value is _MISS else check_record(self.namespace, key, name, value, bad, self._where)
            out.append(payload)
            if shard is not None:
                shard.stats.add(queries=1, hits=int(payload is not None), read_bytes=len(payload) if payload else 0)
        found = [p for p in out if p is not None]
        self.stats.add(queries=len(keys), hits=len(found), read_bytes=sum(len(p) for p in found))
        if bad:
            self.stats.error("corrupt", len(bad))
            self._run(bad, lambda name: ("DEL", name))  # best effort, as the single-node tier
        return out

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[tuple[bytes, bytes | memoryview]]:
        names = [redis_key(k) for k, _ in items]
        records = {name: (key, memoryview(p).cast("B")) for name, (key, p) in zip(names, items, strict=True)}
        px = () if self._ttl_ms is None else ("PX", self._ttl_ms)

        def set_record(name: bytes) -> Command:
            key, payload = records[name]
            return ("SET", name, encode(self.namespace, key, payload), *px)

        shards: list[_Shard | None] = [None] * len(names)
        replies = self._run(names, set_record, shards)
        for name, reply, shard in zip(names, replies, shards, strict=True):
            nbytes = records[name][1].nbytes if reply is not _MISS else 0
            stored = int(reply is not _MISS)
            self.stats.add(stored_blocks=stored, dropped_writes=1 - stored, written_bytes=nbytes)
            if shard is not None:
                shard.stats.add(stored_blocks=stored, dropped_writes=1 - stored, written_bytes=nbytes)
        return []  # each shard makes room by itself (maxmemory-policy)

    @property
    def used_bytes(self) -> int:
        """Every master's `used_memory`, summed (0 until known)."""
        return self._memory.get()[0]

    @property
    def capacity_bytes(self) -> int | None:
        """Every master's `maxmemory`, summed; None where one has none (or none is known yet)."""
        return self._memory.get()[1]

    @property
    def breaker_state(self) -> BreakerState:
        """Closed while any shard serves; open when every one (or discovery) has stepped aside."""
        states = {s.breaker.state for s in self._known_shards()} or {self._discovery.state}
        if BreakerState.CLOSED in states:
            return BreakerState.CLOSED
        return BreakerState.HALF_OPEN if BreakerState.HALF_OPEN in states else BreakerState.OPEN

    def shards(self) -> list[ShardSnapshot]:
        return [
            ShardSnapshot(
                s.name, s.stats.queries, s.stats.hits, s.stats.read_bytes, s.stats.written_bytes,
                dict(s.stats.errors), int(s.breaker.state),
            )
            for s in self._known_shards()
        ]  # fmt: skip

    def shard_of(self, key: bytes) -> str | None:
        """The master (host:port) that serves tier key `key` now; None where none is known."""
        cluster = self._client()
        try:
            return None if cluster is None else cluster.nodes_manager.get_node_from_slot(key_slot(redis_key(key))).name
        except RedisClusterException:
            return None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._cluster is not None:
            self._cluster.close()

    # one pipeline per shard

    def _run(
        self, names: list[bytes], command: Callable[[bytes], Command], shards: list[_Shard | None] | None = None
    ) -> list[object]:
        """One reply per name, _MISS where it got none; `shards[i]`: the shard name i was sent to last."""
        out: list[object] = [_MISS] * len(names)
        shards = [None] * len(names) if shards is None else shards
        cluster = self._client() if names else None
        if cluster is None:
            return out
        redirects: list[tuple[int, AskError]] = []
        groups = list(self._by_node(cluster, names).values())
        for node, idx in groups:
            for i in idx:
                shards[i] = self._shard(node.name)
        for (_, idx), replies in zip(groups, self._send_all(cluster, groups, names, command), strict=True):
            for i, reply in zip(idx, replies or (), strict=False):
                if isinstance(reply, AskError):  # MovedError is one too
                    redirects.append((i, reply))
                elif not isinstance(reply, Exception):
                    out[i] = reply
        if redirects:
            self._follow(cluster, names, command, redirects, out, shards)
        return out

    def _by_node(self, cluster: RedisCluster, names: list[bytes]) -> dict[str, _Group]:
        groups: dict[str, _Group] = {}
        for i, name in enumerate(names):
            try:
                node = cluster.nodes_manager.get_node_from_slot(key_slot(name))
            except RedisClusterException:  # a slot no master serves now: a miss, and a map to refresh
                self._ask_refresh(cluster)
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        return groups

    def _follow(
        self,
        cluster: RedisCluster,
        names: list[bytes],
        command: Callable[[bytes], Command],
        redirects: list[tuple[int, AskError]],
        out: list[object],
        shards: list[_Shard | None],
    ) -> None:
        """Each redirected command once more, at the node its MOVED or ASK named."""
        groups: dict[str, _Group] = {}
        for i, err in redirects:
            if isinstance(err, MovedError):
                cluster.nodes_manager.move_slot(err)
            node = cluster.nodes_manager.get_node(host=err.host, port=err.port)
            if node is not None:
                groups.setdefault(node.name, (node, []))[1].append(i)
        self._ask_refresh(cluster)
        for node, idx in groups.values():
            for i in idx:
                shards[i] = self._shard(node.name)
            # ASKING is what an ASK needs, and harmless before a MOVED one's retry
            replies = self._send(cluster, node, [c for i in idx for c in (("ASKING",), command(names[i]))])
            for i, reply in zip(idx, (replies or [])[1::2], strict=False):
                if not isinstance(reply, Exception):
                    out[i] = reply

    def _send_all(
        self,
        cluster: RedisCluster,
        groups: list[_Group],
        names: list[bytes],
        command: Callable[[bytes], Command],
    ) -> list[list[object] | None]:
        """Each group's pipeline to its node, all shards at once: each serves its part while the
        others' replies are read (one shard after another ran at ~0.6x one node's bandwidth)."""

        def send(group: _Group) -> list[object] | None:
            node, idx = group
            return self._send(cluster, node, [command(names[i]) for i in idx])

        if len(groups) == 1:
            return [send(groups[0])]
        return list(self._pool.map(send, groups))

    def _send(self, cluster: RedisCluster, node: ClusterNode, commands: list[Command]) -> list[object] | None:
        """The replies of one pipeline to `node` (errors among them as exceptions); None where its
        breaker refused or the call failed."""

        def call() -> list[object]:
            pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
            for c in commands:
                pipe.execute_command(*c)
            replies = pipe.execute(raise_on_error=False)
            down = next((r for r in replies if isinstance(r, ClusterDownError)), None)
            if down is not None:  # the shard answers but will not serve: a fault, as a dead one
                raise down
            return replies

        return self._call(cluster, node, call)

    def _call(self, cluster: RedisCluster, node: ClusterNode, call: Callable[[], list[object]]) -> list[object] | None:
        shard = self._shard(node.name)
        if not shard.breaker.allow():
            return None
        try:
            result = call()
        except _FAULTS as exc:
            self._failed(shard, exc)
            self._ask_refresh(cluster)
            return None
        except BaseException as exc:  # a bug, an interrupt: still report the probe, as the single-node tier
            self._failed(shard, exc)
            raise
        self._succeeded(shard)
        return result

    # the cluster, its map and its shards

    def _client(self) -> RedisCluster | None:
        if self._cluster is not None:
            return self._cluster
        if not self._discovery.allow():
            return None
        try:
            cluster = self._connect()
        except _FAULTS as exc:
            self._discovery.failure()
            # redis-py says "unreachable" with an exception of its own, not a ConnectionError
            self.stats.error("connection" if isinstance(exc, RedisClusterException) else error_kind(exc))
            if self._discovery.state != BreakerState.CLOSED and not self._undiscovered:
                self._undiscovered = True
                logger.warning("Redis Cluster tier %s: no seed node answers (%s: %s); lookups miss until one does",
                               self._where, type(exc).__name__, exc)  # fmt: skip
            return None
        self._discovery.success()
        with self._lock:
            if self._cluster is None:
                self._cluster = cluster
                return cluster
        cluster.close()  # another thread connected first
        return self._cluster

    def _connect(self) -> RedisCluster:
        socket_timeout, connect_timeout = self._timeouts
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self._url.nodes],
            username=self._url.username,
            password=self._url.password,
            ssl=self._url.ssl,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            # no retries: a cache would rather miss at once; the breakers handle a shard that stays down
            retry=Retry(NoBackoff(), 0),
            require_full_coverage=False,  # a dead shard's slots uncovered: the others still serve
            health_check_interval=HEALTH_CHECK_INTERVAL,
        )

    def _ask_refresh(self, cluster: RedisCluster) -> None:
        """Reread the slot map (a failover, a migration), at most once per REFRESH_INTERVAL."""
        now = time.monotonic()
        with self._lock:
            if now < self._refresh_due:
                return
            self._refresh_due = now + REFRESH_INTERVAL
        try:
            cluster.nodes_manager.initialize()
        except _FAULTS as exc:
            logger.debug("Redis Cluster tier %s: slot map refresh failed (%s)", self._where, exc)
            return
        self._drop_departed({n.name for n in cluster.get_primaries()})

    def _drop_departed(self, masters: set[str]) -> None:
        """Forget shards the slot map no longer names (a master replaced by its promoted replica),
        so that /metrics and the dashboard show the cluster as it is, not every master it had."""
        with self._lock:
            departed = [name for name in self._shards if name not in masters]
            for name in departed:
                del self._shards[name]
        if departed:
            logger.info("Redis Cluster tier: %s no longer a master of the cluster; dropped", ", ".join(departed))

    def _shard(self, name: str) -> _Shard:
        shard = self._shards.get(name)
        if shard is None:
            with self._lock:
                shard = self._shards.setdefault(name, _Shard(name, self._new_breaker(), TierStats()))
        return shard

    def _known_shards(self) -> list[_Shard]:
        with self._lock:
            return sorted(self._shards.values(), key=lambda s: s.name)

    def _fetch_memory(self) -> MemoryFigures | None:
        """Every master's figures, summed (maxmemory None where one has none); None where one fails."""
        cluster = self._client()
        if cluster is None:
            return None
        infos = [self._call(cluster, n, lambda n=n: [cluster.get_redis_connection(n).info("memory")])
                 for n in cluster.get_primaries()]  # fmt: skip
        if not infos or any(i is None for i in infos):
            return None
        figures = [(int(i[0].get("used_memory", 0)), int(i[0].get("maxmemory", 0))) for i in infos]
        capped = all(cap for _, cap in figures)
        return sum(u for u, _ in figures), sum(c for _, c in figures) if capped else None

    def _succeeded(self, shard: _Shard) -> None:
        with self._lock:
            shard.breaker.success()
            came_back, shard.stepped_aside = shard.stepped_aside, False
        if came_back:
            logger.info("Redis Cluster tier: shard %s reachable again; serving its blocks", shard.name)

    def _failed(self, shard: _Shard, exc: BaseException) -> None:
        kind = "cluster_down" if isinstance(exc, ClusterDownError) else error_kind(exc)
        self.stats.error(kind)
        shard.stats.error(kind)
        with self._lock:
            shard.breaker.failure()
            opened = not shard.stepped_aside and shard.breaker.state != BreakerState.CLOSED
            shard.stepped_aside = shard.stepped_aside or opened
        if opened:
            logger.warning(
                "Redis Cluster tier: shard %s stepping aside after %d failed calls in a row (last: %s, %s: %s); "
                "its keys miss until a retry in %.1f s (or later) succeeds; the other shards serve on",
                shard.name, shard.breaker.failure_threshold, kind, type(exc).__name__, exc, shard.breaker.cooldown,
            )  # fmt: skip
