"""The replicas behind the router: what each is (`GET /server_info`), whether it lives, how loaded it is.

Active checks: `GET /health` every `interval` (<= 1 s) with a timeout of HEALTH_TIMEOUT;
two failures in a row (or two 5xx answers to requests) and the replica is dead: a frozen
replica is out within interval + 2 timeouts (1.5 s by default, 2 s at most). A check that
times out while the replica streams tokens to the router is no failure: busy with a long
prefill on one core, a replica can be slow to answer /health, and counting those killed
live replicas (and their caches) on an overloaded host. Passive checks: a refused or reset
connection kills it at once (a timeout alone never does: an overloaded router sees those
everywhere, and two checks decide). A dead replica gets no requests (unless every replica
is dead and it died of timeouts: then it is tried anyway, as Envoy's panic mode does),
its index is dropped and its requests in flight are cut (the proxy retries or migrates
them); it is checked on, and once it answers again it is discovered and indexed from
scratch. Load comes from the router's own requests in flight and from the replica's
`GET /load` (read every LOAD_EVERY checks).

Roles (P/D disaggregation): a replica given as --prefill or --decode has that role; one given
as --replica has the role its /server_info reports ("both" where it reports none, as a replica
from before roles does). Requests are served by decode and both replicas (migrations too);
prefill replicas only compute prompts handed to a decode replica (`proxy.py`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvserve.kv_cache.events import KVCacheEvent
from kvserve.logger import logger
from kvserve.router.args import HEALTH_INTERVAL
from kvserve.router.index import BlockIndex, CachedRun, SentBlocks

FAILURE_THRESHOLD = 2  # failed checks (or 5xx answers) in a row that make a replica dead
HEALTH_TIMEOUT = 0.5  # seconds: a frozen replica is out within interval + 2 timeouts = 1.5 s
LOAD_EVERY = 2  # read /load every this many checks (once a second)
# events expected (a request stored new blocks) and none came for this long: the index is stale
EVENTS_STALE_AFTER = 3.0
SERVING_ROLES = ("decode", "both")  # the roles that answer a client's request themselves
# A prefill replica with more requests than this waiting (its /load, or the router's own prefills
# sent it and not yet answered less the one it computes, whichever is more) is backed up: a long
# prompt queued behind two others waits for their whole prefills, longer than a decode replica
# takes to compute it itself, so the request prefills locally instead (Dynamo's and llm-d's queue
# check before a remote prefill).
PREFILL_QUEUE_LIMIT = 2


class State(StrEnum):
    STARTING = "starting"  # not yet discovered
    HEALTHY = "healthy"
    DEAD = "dead"


@dataclass(frozen=True)
class EventsInfo:
    endpoint: str
    replay_endpoint: str | None
    topic: str


@dataclass(frozen=True)
class ServerInfo:
    """A replica's `GET /server_info`, the part the router uses."""

    model: str
    served_model_name: str
    tokenizer_dir: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    kv_events: EventsInfo | None
    api_keys_required: bool
    role: str = "both"  # what it reported; a replica from before roles reports none

    @classmethod
    def from_json(cls, data: dict[str, Any], replica_url: str) -> ServerInfo:
        events = data.get("kv_events")
        return cls(
            model=data["model"],
            served_model_name=data["served_model_name"],
            tokenizer_dir=data["tokenizer_dir"],
            block_size=int(data["block_size"]),
            num_kv_blocks=int(data["num_kv_blocks"]),
            max_model_len=int(data["max_model_len"]),
            kv_events=None
            if events is None
            else EventsInfo(
                _dialable(events["endpoint"], replica_url),
                _dialable(events["replay_endpoint"], replica_url) if events.get("replay_endpoint") else None,
                events.get("topic", ""),
            ),
            api_keys_required=bool(data.get("api_keys_required", False)),
            role=str(data.get("role") or "both"),
        )


def _dialable(endpoint: str, replica_url: str) -> str:
    """A replica on another host says 127.0.0.1 when it listens on a wildcard: dial the host we reach it by."""
    host = urlsplit(replica_url).hostname or "127.0.0.1"
    if endpoint.startswith("tcp://") and urlsplit(endpoint).hostname in ("127.0.0.1", "localhost", "::1"):
        if host not in ("127.0.0.1", "localhost", "::1"):
            return f"tcp://{host}:{endpoint.rpartition(':')[2]}"
    return endpoint


@dataclass
class Flight:
    """One request the router has on a replica: counts towards its load until it ends."""

    prompt_tokens: int
    uncached_tokens: int  # prefill still to do, until the first token comes
    abort: Callable[[], None] = lambda: None  # cuts it (its replica died)
    generated: int = 0
    started: bool = False


@dataclass
class ReplicaLoad:
    """From the replica's /load: the KV its other clients hold (its gauge, less the router's own then)."""

    running: float = 0.0
    waiting: float = 0.0
    others_tokens: float = 0.0


@dataclass
class Replica:
    index: int  # its place in --replica: a label for logs and metrics, never a tie-breaker
    url: str
    state: State = State.STARTING
    info: ServerInfo | None = None
    failures: int = 0
    events: BlockIndex = field(default_factory=BlockIndex)
    sent: SentBlocks = field(default_factory=lambda: SentBlocks(0))
    subscriber: Any = None  # a KVEventSubscriber while its events are followed
    flights: dict[int, Flight] = field(default_factory=dict)  # by id()
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    events_expected_since: float | None = None  # a request that stored blocks started then (monotonic)
    events_expected_at: float = 0.0  # ... and ended then
    events_lost: int = 0  # the subscriber's missed_batches when last looked at
    refused: bool = False  # it refused or reset a connection since it was last discovered
    events_stale: bool = False
    configured_role: str | None = None  # from --prefill / --decode; None: from --replica, as reported

    @property
    def role(self) -> str:
        if self.configured_role is not None:
            return self.configured_role
        return self.info.role if self.info is not None else "both"

    @property
    def serves(self) -> bool:
        """It answers a client's request itself (a prefill replica only computes prompts for others)."""
        return self.role in SERVING_ROLES

    def backed_up(self) -> bool:
        """A prefill replica with more than PREFILL_QUEUE_LIMIT requests waiting."""
        # the router's own prefills there count too (its /load is up to a second old), less the one computing
        waiting = max(self.load.waiting, len(self.flights) - 1)
        return waiting > PREFILL_QUEUE_LIMIT

    @property
    def routable(self) -> bool:
        return self.state is State.HEALTHY

    def events_fresh(self, now: float) -> bool:
        """Its events index can be trusted: it has events and they have not stopped."""
        sub = self.subscriber
        if sub is None:
            return False
        since = self.events_expected_since
        if since is None:
            return True
        if sub.last_event_time is not None and sub.last_event_time >= since:
            if self.events_stale:
                logger.info("router: replica %d's KV events came again; scoring it by them", self.index)
            self.events_expected_since, self.events_stale = None, False  # they came
            return True
        if now - self.events_expected_at < EVENTS_STALE_AFTER:
            return True
        if not self.events_stale:
            self.events_stale = True
            logger.warning("router: replica %d's KV events stopped; scoring it by what was sent it", self.index)
        return False

    def cached_run(self, keys: list[bytes], now: float) -> CachedRun:
        if self.events_fresh(now):
            return self.events.cached_run(keys)
        return self.sent.cached_run(keys)

    def forget_if_events_lost(self) -> None:
        """Batches a replay could not bring back leave the index wrong in unknown places: start it again
        (a block it then misses is only a miss; a block it wrongly kept would be a wrong prediction)."""
        lost = getattr(self.subscriber, "missed_batches", 0)
        if lost > self.events_lost:
            logger.warning("router: replica %d lost %d event batches; its index starts again", self.index, lost)
            self.events.clear()
        self.events_lost = lost

    def add_flight(self, flight: Flight) -> None:
        self.flights[id(flight)] = flight

    def end_flight(self, flight: Flight) -> None:
        self.flights.pop(id(flight), None)

    def expect_events(self, since: float) -> None:
        """A request that started at `since` stored new blocks: events must follow, or the index is stale."""
        if self.subscriber is not None and self.events_expected_since is None:
            self.events_expected_since, self.events_expected_at = since, time.monotonic()

    def pending_prefill_tokens(self) -> int:
        return sum(f.uncached_tokens for f in self.flights.values() if not f.started)

    def streamed_tokens(self) -> int:
        return sum(f.generated for f in self.flights.values())

    def router_tokens(self) -> int:
        return sum(f.prompt_tokens + f.generated for f in self.flights.values())

    def active_tokens(self) -> float:
        """KV the replica holds for running requests: the router's own, counted now (the gauge is up to a
        second old: a request that just ended would still weigh), plus what others held at the last read."""
        return self.router_tokens() + self.load.others_tokens

    def load_tokens(self) -> float:
        return self.pending_prefill_tokens() + self.active_tokens()

    def summary(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "index": self.index,
            "url": self.url,
            "role": self.role,
            "state": self.state.value,
            "model": self.info.served_model_name if self.info else None,
            "in_flight": len(self.flights),
            "events": None if self.subscriber is None else ("fresh" if self.events_fresh(now) else "stale"),
            "last_seq": self.subscriber.last_seq if self.subscriber is not None else None,
            "indexed_blocks": self.events.sizes(),
            "sent_blocks": len(self.sent),
            "load_tokens": self.load_tokens(),
        }


StateListener = Callable[[Replica, State, str], None]
Subscribe = Callable[[EventsInfo, Callable[[int, float, list[KVCacheEvent]], None]], Any]
OnDiscovered = Callable[[Replica], Any]  # awaitable: e.g. load and check the tokenizer


class ReplicaSet:
    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        subscribe: Subscribe | None,
        interval: float = HEALTH_INTERVAL,
        roles: list[str | None] | None = None,
    ):
        """`roles[i]`: replica i's role from the command line, None where its /server_info decides."""
        roles = roles or [None] * len(urls)
        pairs = zip(urls, roles, strict=True)
        self.replicas = [Replica(i, url.rstrip("/"), configured_role=role) for i, (url, role) in enumerate(pairs)]
        self.client = client
        self.subscribe = subscribe  # None: the router cannot read events (no shared cache secret)
        self.interval = interval
        self.listeners: list[StateListener] = []
        self.on_discovered: list[OnDiscovered] = []
        self._task: asyncio.Task | None = None
        self._ticks = 0

    def routable(self) -> list[Replica]:
        return [r for r in self.replicas if r.routable]

    def candidates(self, exclude: set[int]) -> list[Replica]:
        """Where a request may go: the routable replicas that serve (decode, both); if none, those dead of
        timeouts alone (they may only have been slow to answer an overloaded router), never one that refused
        a connection."""
        serving = [r for r in self.replicas if r.serves]
        routable = [r for r in serving if r.routable and r.index not in exclude]
        if routable or any(r.routable for r in serving):
            return routable
        return [r for r in serving if r.info is not None and not r.refused and r.index not in exclude]

    def prefill_candidates(self, exclude: set[int]) -> list[Replica]:
        """Where a prompt may be prefilled for a decode replica: healthy prefill replicas not backed up
        (no panic mode here: without one the decode replica prefills itself)."""
        prefill = [r for r in self.replicas if r.role == "prefill" and r.routable and r.index not in exclude]
        return [r for r in prefill if not r.backed_up()]

    def info(self) -> ServerInfo | None:
        return next((r.info for r in self.replicas if r.info is not None and r.routable), None) or next(
            (r.info for r in self.replicas if r.info is not None), None
        )

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="kvserve-router-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for r in self.replicas:
            self._unsubscribe(r)

    async def _loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # a bug must not stop the checks
                logger.exception("router: health check round failed")
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - started)))

    async def check_all(self) -> None:
        self._ticks += 1
        read_load = self._ticks % LOAD_EVERY == 0
        await asyncio.gather(*(self._check(r, read_load) for r in self.replicas))

    async def _check(self, r: Replica, read_load: bool) -> None:
        streamed = r.streamed_tokens()
        try:
            ok = (await self.client.get(f"{r.url}/health", timeout=HEALTH_TIMEOUT)).status_code == 200
        except httpx.ConnectError as e:
            self.connection_failed(r, e)
            return
        except httpx.TimeoutException:
            if r.state is State.HEALTHY and r.streamed_tokens() != streamed:
                return  # slow to answer, but working: neither a failure nor a success
            ok = False
        except httpx.HTTPError:
            ok = False
        if not ok:
            self.failed(r, "health check failed")
            return
        if r.state is not State.HEALTHY:
            await self._discover(r)
        else:
            r.failures = 0
            r.forget_if_events_lost()
        if read_load and r.routable:
            await self.read_load(r)

    async def _discover(self, r: Replica) -> None:
        """Learn what it serves and start indexing it from nothing."""
        try:
            response = await self.client.get(f"{r.url}/server_info", timeout=max(self.interval, 2.0))
            response.raise_for_status()
            info = ServerInfo.from_json(response.json(), r.url)
        except (httpx.HTTPError, KeyError, ValueError, TypeError) as e:
            logger.warning("router: replica %s answers /health but not /server_info: %s", r.url, e)
            return
        reason = self._incompatible(info)
        if reason:
            logger.error("router: replica %s left out: %s", r.url, reason)
            return
        if r.configured_role is not None and info.role != r.configured_role:
            logger.warning(
                "router: replica %s given as %s reports role %r: routing it as %s",
                r.url,
                r.configured_role,
                info.role,
                r.configured_role,
            )
        self._unsubscribe(r)
        r.info, r.failures, r.refused = info, 0, False
        r.events, r.sent = BlockIndex(), SentBlocks(info.num_kv_blocks)
        r.events_expected_since, r.events_lost, r.events_stale = None, 0, False
        if info.kv_events is not None and self.subscribe is not None:
            try:  # fed into this index only: a subscriber still closing cannot write into the next one
                r.subscriber = self.subscribe(info.kv_events, r.events.on_batch)
            except Exception as e:  # a bad address: route by what the router sent instead
                logger.warning("router: cannot follow the KV events of %s: %s", r.url, e)
        for hook in self.on_discovered:
            await hook(r)
        self._set_state(r, State.HEALTHY, "discovered")

    def _incompatible(self, info: ServerInfo) -> str | None:
        other = next((r.info for r in self.replicas if r.info is not None and r.routable), None)
        if other is None:
            return None
        if (info.served_model_name, info.block_size) != (other.served_model_name, other.block_size):
            return (
                f"serves {info.served_model_name!r} with block size {info.block_size}, the others "
                f"{other.served_model_name!r} with {other.block_size}"
            )
        return None

    async def read_load(self, r: Replica) -> None:
        try:
            now = (await self.client.get(f"{r.url}/load", timeout=HEALTH_TIMEOUT)).json()
            running, waiting = float(now["num_requests_running"]), float(now["num_requests_waiting"])
            usage = float(now["kv_cache_usage_perc"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return  # /health decides whether it lives
        capacity = r.info.num_kv_blocks * r.info.block_size if r.info else 0
        r.load = ReplicaLoad(running, waiting, max(0.0, usage * capacity - r.router_tokens()))

    # failures, from the checks and from the proxy

    def connection_failed(self, r: Replica, error: Exception) -> None:
        """Refused or reset: the process is gone (or its port is), no need to wait for a second opinion."""
        r.refused = True
        if r.state is not State.DEAD:
            self._kill(r, f"connection failed: {type(error).__name__}")

    def failed(self, r: Replica, reason: str) -> None:
        """A failed check or a 5xx: dead after FAILURE_THRESHOLD in a row."""
        r.failures += 1
        if r.failures >= FAILURE_THRESHOLD and r.state is State.HEALTHY:
            self._kill(r, reason)

    def succeeded(self, r: Replica) -> None:
        r.failures = 0

    def _kill(self, r: Replica, reason: str) -> None:
        previous = r.state
        self._unsubscribe(r)
        r.events.clear()
        r.sent.clear()
        r.events_expected_since = None
        self._set_state(r, State.DEAD, reason)
        if previous is State.HEALTHY:
            for flight in list(r.flights.values()):
                flight.abort()

    def _unsubscribe(self, r: Replica) -> None:
        if r.subscriber is not None:  # its thread stops within a poll; do not wait for it here
            threading.Thread(target=r.subscriber.close, name="kvserve-router-unsubscribe", daemon=True).start()
            r.subscriber = None

    def _set_state(self, r: Replica, state: State, reason: str) -> None:
        if r.state is state:
            return
        previous, r.state = r.state, state
        log = logger.warning if state is State.DEAD else logger.info
        log("router: replica %d (%s) %s -> %s: %s", r.index, r.url, previous.value, state.value, reason)
        for listener in self.listeners:
            listener(r, state, reason)
