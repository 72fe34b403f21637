"""The router's `GET /debug/kv_state`: each replica's routing numbers and state, and its own
`/debug/kv_state` (fetched with the caller's key, as every other request is forwarded), so the
dashboard page draws one panel per replica.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from kvserve.router.metrics import RouterMetrics
from kvserve.router.replicas import Replica

FETCH_TIMEOUT = 2.0  # seconds: a slow replica's panel says so instead of holding the others'


async def router_state(
    replicas: list[Replica], metrics: RouterMetrics, client: httpx.AsyncClient, authorization: str | None
) -> dict[str, Any]:
    fetched = await asyncio.gather(*(_replica_kv_state(client, r, authorization) for r in replicas))
    return {
        "kind": "router",
        "taken": time.time(),
        "replicas": [_replica(r, metrics, state, error) for r, (state, error) in zip(replicas, fetched, strict=True)],
    }


def _replica(r: Replica, metrics: RouterMetrics, state: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    summary = r.summary()

    def counter(name: str) -> int:
        value = metrics.registry.get_sample_value(f"kvserve:router_{name}_total", {"replica": r.url})
        return int(value or 0)

    return {
        "index": r.index,
        "url": r.url,
        "state": summary["state"],
        "in_flight": summary["in_flight"],
        "load_tokens": summary["load_tokens"],
        "events": summary["events"],
        "routed": counter("requests_routed"),
        "predicted_cached_tokens": counter("predicted_cached_tokens"),
        "reported_cached_tokens": counter("reported_cached_tokens"),
        "mispredicted": counter("cached_tokens_mispredicted"),
        "kv_state": state,
        "error": error,
    }


async def _replica_kv_state(
    client: httpx.AsyncClient, r: Replica, authorization: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """(its /debug/kv_state, None), or (None, why not)."""
    if not r.routable:
        return None, f"replica is {r.state.value}"
    headers = {"authorization": authorization} if authorization else {}
    try:
        response = await client.get(f"{r.url}/debug/kv_state", headers=headers, timeout=FETCH_TIMEOUT)
    except httpx.HTTPError as e:
        return None, f"no answer: {type(e).__name__}"
    if response.status_code != 200:
        return None, f"/debug/kv_state answered {response.status_code}"
    return response.json(), None
