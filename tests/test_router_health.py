"""Active health checks: a frozen replica is out after two failed checks, a busy one is not."""

from __future__ import annotations

import asyncio

import httpx

from kvserve.router.replicas import FAILURE_THRESHOLD, Flight, ReplicaSet, ServerInfo, State

INFO = ServerInfo("m", "m", "", 16, 1000, 2048, None, False)


def replica_set(on_health) -> ReplicaSet:
    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        return await on_health()

    replicas = ReplicaSet(["http://r0"], httpx.AsyncClient(transport=httpx.MockTransport(handler)), None)
    r = replicas.replicas[0]
    r.state, r.info = State.HEALTHY, INFO
    return replicas


async def timed_out() -> httpx.Response:
    raise httpx.ReadTimeout("health check timed out")


def test_a_replica_whose_checks_time_out_with_nothing_streamed_is_dead():
    replicas = replica_set(timed_out)
    r = replicas.replicas[0]
    r.add_flight(Flight(prompt_tokens=100, uncached_tokens=100))  # in flight, but no token comes
    for _ in range(FAILURE_THRESHOLD):
        asyncio.run(replicas.check_all())
    assert r.state is State.DEAD


def test_a_replica_streaming_tokens_while_its_checks_time_out_stays_healthy():
    flight = Flight(prompt_tokens=100, uncached_tokens=100)

    async def busy() -> httpx.Response:
        flight.generated += 1  # a token reaches the router while /health waits behind the step
        raise httpx.ReadTimeout("health check timed out")

    replicas = replica_set(busy)
    r = replicas.replicas[0]
    r.add_flight(flight)
    for _ in range(3 * FAILURE_THRESHOLD):
        asyncio.run(replicas.check_all())
    assert r.state is State.HEALTHY and r.failures == 0
