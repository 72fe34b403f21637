"""A replica's `GET /debug/kv_state`: the engine's latest `KVState`, the latency totals /metrics
has, and the last minutes (`DashboardHistory`), as the dashboard page reads them.

Counters keep /metrics' units: tokens for the prefix cache and the tiers' hits, blocks for
the pool. Nothing here names a tenant: blocks in use carry the engine's digests.
"""

from __future__ import annotations

from typing import Any

from kvserve.engine.client import EngineClient, EngineDeadError
from kvserve.engine.kv_state import KVState
from kvserve.kv_cache.tiers.base import ShardSnapshot
from kvserve.kv_cache.tiers.store import TierSnapshot
from kvserve.server.dashboard_history import DashboardHistory, histogram_totals
from kvserve.server.errors import APIError
from kvserve.server.metrics import ServerMetrics


async def replica_state(
    engine: EngineClient, metrics: ServerMetrics, history: DashboardHistory, model: str
) -> dict[str, Any]:
    try:
        state = await engine.kv_state()
    except (EngineDeadError, TimeoutError) as e:  # stopped, or busy in one step for seconds before any snapshot
        raise APIError(503, f"no KV state to show: {e or 'the engine is busy'}", type="server_error") from e
    ttft = histogram_totals(metrics.latency.ttft)
    itl = histogram_totals(metrics.latency.itl)
    return {
        "kind": "replica",
        "model": model,
        "role": engine.replica_info.role,
        "handoffs": _handoffs(engine, metrics),
        "taken": state.taken,
        "step": state.step,
        "pool": _pool(state),
        "prefix_cache": _prefix_cache(state, history),
        "tiers": [_tier(t, state.block_size) for t in state.tiers],
        "requests": {
            "running": state.num_running,
            "waiting": state.num_waiting,
            "loading": state.num_loading,
            "preemptions": state.num_preemptions,
            "prompt_tokens": state.prompt_tokens,
            "generation_tokens": state.generation_tokens,
        },
        "latency": {
            "ttft": {"count": ttft[0], "sum": ttft[1]},
            "itl": {"count": itl[0], "sum": itl[1]},
        },
        "history": history.to_json(),
    }


def _handoffs(engine: EngineClient, metrics: ServerMetrics) -> dict[str, int]:
    """Prefill/decode handoffs, direct path: leases, blocks and bytes sent and received, failed pulls,
    read from the /metrics registry."""
    load = engine.load()
    out = {"leases": load.kv_leases, "lease_expiries": load.kv_lease_expiries}
    for direction in ("sent", "received"):
        for unit in ("blocks", "bytes"):
            out[f"{direction}_{unit}"] = int(metrics.value(f"kv_transfer_{unit}_total", direction=direction))
    out["load_failures"] = int(metrics.value("kv_load_failures_total"))
    return out


def _pool(state: KVState) -> dict[str, Any]:
    return {
        "num_blocks": state.num_blocks,
        "block_size": state.block_size,
        "blocks": state.blocks,  # "." free, ":" cached and evictable, tenant letter (upper case: shared)
        "free": state.num_free,
        "evictable": state.num_evictable,
        "used": state.num_used,
        "shared": state.num_shared,
        "usage": state.num_used / state.num_blocks,  # as kvserve:kv_cache_usage_perc
        "tenants": [{"letter": t.letter, "digest": t.digest, "blocks": t.blocks} for t in state.tenants],
    }


def _prefix_cache(state: KVState, history: DashboardHistory) -> dict[str, Any]:
    return {
        "kind": state.prefix_cache,
        "cached_blocks": state.cached_blocks,
        "evictions": state.evictions,  # as kvserve:prefix_cache_evictions
        "queries": state.prefix_queries,
        "hits": state.prefix_hits,
        "hit_rate": state.prefix_hits / state.prefix_queries if state.prefix_queries else None,
        "recent_hit_rate": history.window_hit_rate(state.prefix_queries, state.prefix_hits),
        "external_queries": state.external_queries,
        "external_hits": state.external_hits,
    }


def _tier(t: TierSnapshot, block_size: int) -> dict[str, Any]:
    return {
        "name": t.name,
        "used_bytes": t.used_bytes,
        "capacity_bytes": t.capacity_bytes,
        "queries": t.queried_blocks * block_size,  # tokens, as kvserve:kv_tier_queries
        "hits": t.served_blocks * block_size,
        "stored_blocks": t.stored_blocks,
        "breaker_state": t.breaker_state,
        "shards": [_shard(s, block_size) for s in t.shards],
    }


def _shard(s: ShardSnapshot, block_size: int) -> dict[str, Any]:
    return {
        "name": s.name,
        "queries": s.queries * block_size,  # tokens, as kvserve:kv_tier_shard_queries
        "hits": s.hits * block_size,
        "read_bytes": s.read_bytes,
        "errors": sum(s.errors.values()),
        "breaker_state": s.breaker_state,
    }
