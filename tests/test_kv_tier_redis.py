"""The Redis tier against a real redis-server: records, faults, the breaker, and what the server sees."""

from __future__ import annotations

import logging
import os
import random
import time
from array import array
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from redis_server import RedisServer

from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.kv_cache.tiers.breaker import BreakerState, CircuitBreaker
from kvserve.kv_cache.tiers.namespace import Namespace, tier_key
from kvserve.kv_cache.tiers.record import encode
from kvserve.kv_cache.tiers.redis_tier import KEY_PREFIX, RedisTier, redis_key
from kvserve.logger import logger

NS = Namespace(model_fingerprint="model-a", kv_dtype="float32", block_size=16, block_shape=(2, 2, 16, 2, 8))
CALL_BOUND = 2.0  # seconds: a dead server costs one bounded timeout per call, not retries


def blocks(n: int, ns: Namespace = NS, seed: int = 0) -> list[tuple[bytes, bytes]]:
    rng = random.Random(seed)
    return [(rng.randbytes(32), rng.randbytes(ns.block_nbytes)) for _ in range(n)]


@pytest.fixture
def raw(redis_server):
    client = redis.Redis(port=redis_server.port)
    yield client
    client.close()


@pytest.fixture
def tier(redis_server):
    t = RedisTier(redis_server.url(), NS)
    yield t
    t.close()


class RoundTrips:
    """Counts the writes of commands to a socket: a pipeline is one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        original = redis.connection.AbstractConnection.send_packed_command

        def counting(conn, command, check_health=True):
            self.count += 1
            return original(conn, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)


def test_round_trip(tier, raw):
    items = blocks(4)
    assert tier.put(items) == []
    got = tier.get([k for k, _ in items] + [os.urandom(32)])
    assert [bytes(p) for p in got[:4]] == [p for _, p in items] and got[4] is None
    assert raw.dbsize() == 4
    s = tier.stats
    assert (s.queries, s.hits, s.stored_blocks) == (5, 4, 4)
    assert s.read_bytes == s.written_bytes == 4 * NS.block_nbytes
    assert not s.errors and tier.available and tier.breaker_state == BreakerState.CLOSED


def test_accepts_any_buffer_and_empty_calls(tier):
    key, payload = blocks(1)[0]
    tier.put([(key, memoryview(payload).cast("f"))])  # a float view still stores its bytes
    assert bytes(tier.get([key])[0]) == payload
    assert tier.contains([]) == 0 and tier.get([]) == [] and tier.put([]) == []
    with pytest.raises(ValueError):
        tier.get([b"short"])


def test_contains_counts_leading_keys_in_one_round_trip(tier, monkeypatch):
    items = blocks(5)
    keys = [k for k, _ in items]
    tier.put(items[:3] + items[4:])  # the 4th is missing
    tier.contains(keys)  # connects first, so the count below is the call alone
    trips = RoundTrips(monkeypatch)
    assert tier.contains(keys) == 3
    assert tier.contains(keys[:2]) == 2
    assert tier.contains(keys[3:]) == 0
    assert tier.get(keys)[3] is None
    tier.put(items[3:4])
    assert tier.contains(keys) == 5
    assert trips.count == 6  # one per call, whatever the number of keys


def test_flipped_byte_is_a_miss_counted_and_deleted(tier, raw):
    (key, payload), (key2, payload2) = blocks(2)
    tier.put([(key, payload), (key2, payload2)])
    value = bytearray(raw.get(redis_key(key)))
    value[-100] ^= 0x01
    raw.set(redis_key(key), bytes(value))
    got = tier.get([key, key2])
    assert got[0] is None and bytes(got[1]) == payload2
    assert tier.stats.errors["corrupt"] == 1 and tier.stats.hits == 1
    assert not raw.exists(redis_key(key)) and raw.exists(redis_key(key2))
    assert tier.breaker_state == BreakerState.CLOSED  # a bad record is not a server fault


@pytest.mark.parametrize(
    "other",
    [
        Namespace(model_fingerprint="model-b", kv_dtype="float32", block_size=16, block_shape=(2, 2, 16, 2, 8)),
        Namespace(model_fingerprint="model-a", kv_dtype="bfloat16", block_size=16, block_shape=(2, 2, 16, 2, 16)),
    ],
    ids=["fingerprint", "dtype"],
)
def test_record_of_another_namespace_is_a_miss(tier, raw, other):
    assert other.block_nbytes == NS.block_nbytes  # only the namespace differs, not the length
    key, payload = blocks(1)[0]
    raw.set(redis_key(key), encode(other, key, payload))  # as a replica of the other model would
    assert tier.get([key]) == [None]
    assert tier.stats.errors["corrupt"] == 1 and not raw.exists(redis_key(key))


def test_truncated_record_and_foreign_value_are_misses(tier, raw):
    (key, payload), (key2, _) = blocks(2)
    raw.set(redis_key(key), encode(NS, key, payload)[:-1])
    raw.set(redis_key(key2), b"not a record")
    assert tier.get([key, key2]) == [None, None]
    assert tier.stats.errors["corrupt"] == 2 and raw.dbsize() == 0


def test_auth_through_the_url():
    server = RedisServer("--requirepass", "s3cret", "--user", "alice", "on", ">wonder", "~*", "+@all")
    try:
        items = blocks(2)
        for url in (server.url(password="s3cret"), server.url(password="wonder", username="alice")):
            good = RedisTier(url, NS)
            good.put(items)
            assert [bytes(p) for p in good.get([k for k, _ in items])] == [p for _, p in items]
            assert not good.stats.errors
            good.close()
        for url in (server.url(password="wrong"), server.url(), server.url(password="s3cret", username="alice")):
            bad = RedisTier(url, NS)
            assert bad.contains([items[0][0]]) == 0
            assert bad.get([k for k, _ in items]) == [None, None]
            assert bad.put(items) == [] and bad.stats.dropped_writes == 2
            assert sum(bad.stats.errors.values()) == 3 and bad.breaker_state == BreakerState.OPEN
            bad.close()
    finally:
        server.close()


def test_db_number_in_the_url(redis_server):
    tier = RedisTier(redis_server.url(db=3), NS)
    items = blocks(1)
    tier.put(items)
    assert redis.Redis(port=redis_server.port, db=3).exists(redis_key(items[0][0]))
    assert redis.Redis(port=redis_server.port, db=0).dbsize() == 0
    assert RedisTier(redis_server.url(db=0), NS).get([items[0][0]]) == [None]
    tier.close()


def test_ttl(redis_server, raw):
    tier = RedisTier(redis_server.url(), NS, ttl=30)
    key, payload = blocks(1)[0]
    tier.put([(key, payload)])
    assert 29_000 < raw.pttl(redis_key(key)) <= 30_000
    tier.close()


def timed(call):
    start = time.monotonic()
    result = call()
    assert time.monotonic() - start < CALL_BOUND
    return result


def assert_misses_then_steps_aside(tier: RedisTier, kind: str, monkeypatch) -> None:
    items = blocks(2)
    keys = [k for k, _ in items]
    assert timed(lambda: tier.contains(keys)) == 0
    assert timed(lambda: tier.get(keys)) == [None, None]
    assert timed(lambda: tier.put(items)) == []
    assert tier.stats.errors[kind] == 3 and tier.stats.dropped_writes == 2
    assert tier.breaker_state == BreakerState.OPEN and not tier.available

    def no_network(*args, **kwargs):
        raise AssertionError("the open breaker let a call reach the connection pool")

    monkeypatch.setattr(tier._client.connection_pool, "get_connection", no_network)
    start = time.monotonic()
    assert tier.contains(keys) == 0 and tier.get(keys) == [None, None] and tier.put(items) == []
    assert time.monotonic() - start < 0.05
    assert tier.stats.errors[kind] == 3 and tier.stats.dropped_writes == 4
    assert tier.stats.queries == 4


def test_killed_server_misses_and_the_breaker_opens(redis_server, monkeypatch):
    tier = RedisTier(redis_server.url(), NS, breaker=CircuitBreaker(cooldown=60.0))
    tier.put(blocks(2))  # a pooled connection, which the kill breaks
    redis_server.kill()
    assert_misses_then_steps_aside(tier, "connection", monkeypatch)
    tier.close()


def test_hung_server_times_out_and_the_breaker_opens(redis_server, monkeypatch):
    tier = RedisTier(redis_server.url(), NS, socket_timeout=0.2, breaker=CircuitBreaker(cooldown=60.0))
    redis_server.pause()
    try:
        assert_misses_then_steps_aside(tier, "timeout", monkeypatch)
    finally:
        redis_server.resume()
    tier.close()


def test_restarted_server_is_used_again_after_the_cooldown(redis_server, caplog):
    logger.addHandler(caplog.handler)  # the kvserve logger does not propagate to the root
    try:
        tier = RedisTier(redis_server.url(), NS, breaker=CircuitBreaker(cooldown=0.2))
        items = blocks(3)
        tier.put(items)
        redis_server.kill()
        for _ in range(5):
            tier.get([items[0][0]])
        assert tier.breaker_state == BreakerState.OPEN
        redis_server.restart()  # same port, empty
        assert tier.get([items[0][0]]) == [None]  # still cooling down: refused, not asked
        time.sleep(0.25)
        assert tier.breaker_state == BreakerState.HALF_OPEN and not tier.available
        tier.put(items)  # the probe
        assert tier.available and tier.contains([k for k, _ in items]) == 3
        assert [bytes(p) for p in tier.get([k for k, _ in items])] == [p for _, p in items]
        tier.close()
    finally:
        logger.removeHandler(caplog.handler)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "stepping aside" in warnings[0].getMessage()
    assert len(infos) == 1 and "reachable again" in infos[0].getMessage()
    assert str(redis_server.port) in warnings[0].getMessage()


def test_memory_figures():
    server = RedisServer("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    try:
        tier = RedisTier(server.url(), NS)
        assert tier.used_bytes > 0 and tier.capacity_bytes == 64 * 1024 * 1024
        tier.close()
    finally:
        server.close()


def test_memory_figures_unbounded_and_cached(redis_server, monkeypatch):
    tier = RedisTier(redis_server.url(), NS)
    assert tier.capacity_bytes is None and tier.used_bytes > 0
    trips = RoundTrips(monkeypatch)
    figures = {(tier.used_bytes, tier.capacity_bytes) for _ in range(10)}
    assert len(figures) == 1
    assert trips.count == 0  # within the cache's age: no INFO per read
    tier.close()


def test_server_sees_neither_salt_nor_token_ids(tier, raw):
    salt = "tenant-7-secret-salt"
    rng = random.Random(1)
    # token ids away from small numbers and the payload length, which the header holds as integers
    tokens = [t for t in (rng.randrange(1000, 49152) for _ in range(4 * NS.block_size + 5)) if t != NS.block_nbytes]
    block_keys = chain_keys(b"", tokens, NS.block_size, extra_key(salt))
    keys = [tier_key(NS.digest, k) for k in block_keys]
    tier.put([(k, os.urandom(NS.block_nbytes)) for k in keys])
    stored = [(name, raw.get(name)) for name in raw.scan_iter(count=1000)]
    assert len(stored) == len(keys) == 4
    secrets = [salt.encode(), salt.encode().hex().encode()]
    secrets += [array("q", [t]).tobytes() for t in tokens]
    secrets += [array("q", tokens[i : i + NS.block_size]).tobytes() for i in range(0, len(tokens), NS.block_size)]
    for name, value in stored:
        assert name.startswith(KEY_PREFIX) and len(name) == len(KEY_PREFIX) + 64
        for secret in secrets:
            assert secret not in name and secret not in value


def test_threads_share_one_tier(tier):
    def work(seed: int) -> bool:
        items = blocks(8, seed=seed)
        tier.put(items)
        return [bytes(p) for p in tier.get([k for k, _ in items])] == [p for _, p in items]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(32)))
    assert (tier.stats.stored_blocks, tier.stats.hits, tier.stats.queries) == (256, 256, 256)
