"""The Redis Cluster tier against a real three-master cluster: keys spread over the shards, one
round trip per shard, redirects followed, a dead shard or cluster a miss with a breaker per
shard, and what the shards see."""

from __future__ import annotations

import os
import random
import time
from array import array

import pytest
import redis
from redis_cluster import RedisClusterServers
from test_kv_tier_redis import NS, RoundTrips, blocks

from kvserve.config import EngineConfig
from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.kv_cache.tiers.breaker import BreakerState, CircuitBreaker
from kvserve.kv_cache.tiers.namespace import tier_key
from kvserve.kv_cache.tiers.redis_cluster_tier import RedisClusterTier, parse_cluster_url
from kvserve.kv_cache.tiers.redis_tier import KEY_PREFIX, RedisTier, redis_key
from kvserve.kv_cache.tiers.remote import remote_tier

CALL_BOUND = 2.0  # seconds: a dead shard costs one bounded timeout per call, not retries


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the module's tests that kill nothing (`redis_cluster`: one of a test's own)."""
    servers = RedisClusterServers()
    yield servers
    servers.close()


@pytest.fixture
def tier(cluster):
    cluster.flush()
    t = RedisClusterTier(cluster.url(seeds=1), NS)  # one seed: the others are discovered
    yield t
    t.close()


def shard_keys(cluster: RedisClusterServers) -> list[set[bytes]]:
    return [set(cluster.keys(i)) for i in range(len(cluster.servers))]


def test_cluster_urls():
    url = parse_cluster_url("rediss+cluster://alice:s%40cret@10.0.0.1:7000,[::1]:7001,node-c:7002/")
    assert url.nodes == (("10.0.0.1", 7000), ("::1", 7001), ("node-c", 7002))
    assert (url.username, url.password, url.ssl) == ("alice", "s@cret", True)
    plain = parse_cluster_url("redis+cluster://:pw@h:1")
    assert (plain.username, plain.password, plain.ssl, plain.nodes) == (None, "pw", False, (("h", 1),))
    assert parse_cluster_url("redis+cluster://h:1").password is None
    for bad in ("redis://h:1", "redis+cluster://h", "redis+cluster://h:1/3", "redis+cluster://h:1,"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)
    assert EngineConfig(kv_remote="redis+cluster://h:1,h:2").kv_remote
    with pytest.raises(ValueError, match="kv_remote"):
        EngineConfig(kv_remote="cluster://h:1")
    assert isinstance(remote_tier("redis+cluster://h:1", NS), RedisClusterTier)
    assert isinstance(remote_tier("redis://h:1/0", NS), RedisTier)


def test_blocks_spread_over_the_shards_and_come_back(tier, cluster):
    items = blocks(48)
    assert tier.put(items) == []
    got = tier.get([k for k, _ in items] + [os.urandom(32)])
    assert [bytes(p) for p in got[:48]] == [p for _, p in items] and got[48] is None
    held = shard_keys(cluster)
    assert all(len(keys) >= 5 for keys in held), [len(k) for k in held]  # no hash tag pins them to one
    assert set().union(*held) == {redis_key(k) for k, _ in items}
    assert sorted(s.name for s in tier.shards()) == sorted(f"127.0.0.1:{p}" for p in cluster.ports)
    for shard in tier.shards():
        held_here = len(held[cluster.ports.index(int(shard.name.rsplit(":", 1)[1]))])
        assert shard.hits == held_here and shard.read_bytes == held_here * NS.block_nbytes
    s = tier.stats
    assert (s.queries, s.hits, s.stored_blocks) == (49, 48, 48) and not s.errors
    assert tier.contains([k for k, _ in items]) == 48 and tier.available


def test_a_get_is_one_round_trip_per_shard(tier, monkeypatch):
    items = blocks(30)
    keys = [k for k, _ in items]
    tier.put(items)
    tier.get(keys)  # every shard's connection made
    trips = RoundTrips(monkeypatch)
    tier.get(keys)
    assert trips.count == 3
    trips.count = 0
    tier.contains(keys)
    assert trips.count == 3


def test_moved_and_ask_are_followed(tier, cluster):
    items = blocks(2)
    tier.put(items)
    (key, payload), (key2, payload2) = items
    client = tier._client()
    slot = client.keyslot(redis_key(key))
    owner = client.nodes_manager.get_node_from_slot(slot)
    wrong = next(n for n in client.get_primaries() if n.name != owner.name)
    client.nodes_manager.slots_cache[slot] = [wrong]  # a stale map: that master answers MOVED
    assert bytes(tier.get([key])[0]) == payload
    assert client.nodes_manager.get_node_from_slot(slot).name == owner.name

    # a slot migrating: the key already moved, so its old master answers ASK
    slot2 = client.keyslot(redis_key(key2))
    src = client.nodes_manager.get_node_from_slot(slot2)
    dst = next(n for n in client.get_primaries() if n.name != src.name)
    src_c, dst_c = redis.Redis(port=src.port), redis.Redis(port=dst.port)
    dst_id, src_id = dst_c.cluster("myid"), src_c.cluster("myid")
    dst_c.execute_command("CLUSTER SETSLOT", slot2, "IMPORTING", src_id)
    src_c.execute_command("CLUSTER SETSLOT", slot2, "MIGRATING", dst_id)
    src_c.execute_command("MIGRATE", "127.0.0.1", dst.port, redis_key(key2), 0, 5000)
    try:
        assert bytes(tier.get([key2])[0]) == payload2
        assert tier.stats.hits == 2 and not tier.stats.errors
    finally:
        for c in (src_c, dst_c):
            c.execute_command("CLUSTER SETSLOT", slot2, "NODE", src_id)  # back where it was
        src_c.close()
        dst_c.close()


def timed(call):
    start = time.monotonic()
    result = call()
    assert time.monotonic() - start < CALL_BOUND
    return result


def test_a_dead_shard_misses_alone_and_its_breaker_opens(redis_cluster, monkeypatch):
    tier = RedisClusterTier(redis_cluster.url(), NS, breaker=lambda: CircuitBreaker(cooldown=60.0))
    items = blocks(60)
    keys = [k for k, _ in items]
    tier.put(items)
    dead_port = redis_cluster.ports[1]
    dead = {k for k in keys if tier.shard_of(k) == f"127.0.0.1:{dead_port}"}
    assert 0 < len(dead) < len(keys)
    redis_cluster.kill(1)
    for _ in range(3):
        got = timed(lambda: tier.get(keys))
        assert all((p is None) == (k in dead) for k, p in zip(keys, got, strict=True))
    states = {s.name: s.breaker_state for s in tier.shards()}
    assert states.pop(f"127.0.0.1:{dead_port}") == BreakerState.OPEN
    assert set(states.values()) == {BreakerState.CLOSED}
    assert tier.available and tier.breaker_state == BreakerState.CLOSED  # the tier as a whole still serves

    dead_node = tier._client().nodes_manager.get_node(host="127.0.0.1", port=dead_port)

    def no_network(*args, **kwargs):
        raise AssertionError("the open breaker let a call reach the dead shard")

    monkeypatch.setattr(dead_node.redis_connection.connection_pool, "get_connection", no_network)
    start = time.monotonic()
    got = tier.get(keys)
    assert time.monotonic() - start < 0.2  # no timeout waited for
    assert sum(p is not None for p in got) == len(keys) - len(dead)
    tier.put(blocks(20, seed=1))  # the live shards take their part
    assert tier.stats.dropped_writes > 0 and tier.stats.stored_blocks > 60
    tier.close()


def test_a_failover_is_a_miss_then_the_promoted_replica_serves_and_the_old_master_is_forgotten():
    servers = RedisClusterServers(replicas=True)
    tier = RedisClusterTier(servers.url(seeds=1), NS, breaker=lambda: CircuitBreaker(cooldown=0.2))
    try:
        items = blocks(60)
        keys = [k for k, _ in items]
        tier.put(items)
        old = f"127.0.0.1:{servers.ports[0]}"
        moved = {k for k in keys if tier.shard_of(k) == old}
        assert 0 < len(moved) < len(keys)
        servers.replicate(0)
        servers.kill(0)
        got = timed(lambda: tier.get(keys))  # the failover in progress: its keys miss, the rest hit
        assert all(p is not None for k, p in zip(keys, got, strict=True) if k not in moved)
        servers.wait_promoted(0)
        deadline = time.monotonic() + 10
        while not all(p is not None for p in timed(lambda: tier.get(keys))):
            assert time.monotonic() < deadline, "the promoted replica's blocks never hit"
            time.sleep(0.25)
        assert tier.get(keys) == [p for _, p in items]
        promoted = f"127.0.0.1:{servers.ports[servers.masters]}"
        assert {tier.shard_of(k) for k in moved} == {promoted}
        names = {s.name for s in tier.shards()}
        assert old not in names and promoted in names and len(names) == 3
        assert {s.breaker_state for s in tier.shards()} == {BreakerState.CLOSED}
    finally:
        tier.close()
        servers.close()


def test_a_cluster_that_is_gone_is_a_miss():
    tier = RedisClusterTier("redis+cluster://127.0.0.1:1,127.0.0.1:2", NS, breaker=lambda: CircuitBreaker(cooldown=60))
    items = blocks(2)
    for _ in range(4):
        assert timed(lambda: tier.get([k for k, _ in items])) == [None, None]
        assert timed(lambda: tier.contains([k for k, _ in items])) == 0
        assert timed(lambda: tier.put(items)) == []
    assert tier.breaker_state == BreakerState.OPEN and not tier.available
    assert tier.stats.errors["connection"] == 3  # discovery's breaker then refused the rest
    assert tier.stats.dropped_writes == 8 and tier.used_bytes == 0
    tier.close()


def test_memory_figures_sum_the_masters(tier, cluster):
    assert tier.used_bytes > 0 and tier.capacity_bytes is None  # these masters have no maxmemory


def test_the_shards_see_neither_salt_nor_token_ids_nor_tenant(tier, cluster):
    tenant, salt = "tenant-acme-corp", "tenant-7-secret-salt"
    rng = random.Random(1)
    tokens = [t for t in (rng.randrange(1000, 49152) for _ in range(12 * NS.block_size + 5)) if t != NS.block_nbytes]
    keys = [tier_key(NS.digest, k) for k in chain_keys(b"", tokens, NS.block_size, extra_key(salt))]
    tier.put([(k, os.urandom(NS.block_nbytes)) for k in keys])
    stored = []
    for i in range(len(cluster.servers)):
        with cluster.client(i) as c:
            stored += [(name, c.get(name)) for name in c.scan_iter(count=1000)]
    assert len(stored) == len(keys) == 12
    secrets = [salt.encode(), salt.encode().hex().encode(), tenant.encode()]
    secrets += [array("q", [t]).tobytes() for t in tokens]
    secrets += [array("q", tokens[i : i + NS.block_size]).tobytes() for i in range(0, len(tokens), NS.block_size)]
    for name, value in stored:
        assert name.startswith(KEY_PREFIX) and len(name) == len(KEY_PREFIX) + 64 and b"{" not in name
        for secret in secrets:
            assert secret not in name and secret not in value
