"""The shared tier `--kv-remote` names: one Redis node, or a Redis Cluster (Valkey too)."""

from __future__ import annotations

from kvserve.kv_cache.tiers.base import KVTier
from kvserve.kv_cache.tiers.namespace import Namespace
from kvserve.kv_cache.tiers.redis_cluster_tier import SCHEMES, RedisClusterTier
from kvserve.kv_cache.tiers.redis_tier import RedisTier


def remote_tier(url: str, namespace: Namespace, **options: float) -> KVTier:
    """redis+cluster:// or rediss+cluster://: the cluster tier; redis://, rediss://, unix://: one node.
    `options`: the tiers' socket_timeout, connect_timeout, ttl."""
    if url.partition("://")[0] in SCHEMES:
        return RedisClusterTier(url, namespace, **options)
    return RedisTier(url, namespace, **options)
