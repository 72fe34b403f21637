"""Forwarding a request to the chosen replica: retried elsewhere until it has started, migrated after.

Before anything reached the client (a whole response, or a stream's first event), a
refused or reset connection, a 5xx or a 429 sends the request to the next best replica
(the 429 without counting against the replica). A client's 4xx is the client's: passed
on as it came, never counted. Once a stream has started, a cut (the connection reset, the
stream ending without [DONE], a server error event, or its replica found dead by a
health check) continues the stream on another replica (`migration`).

Requests and streams go through aiohttp, whose HTTP parser is in C: relaying a stream
costs a parse of every token's chunk, and httpx's pure-Python one took ~3.5x the CPU
(177 against 49 us a chunk). The replicas' control plane (health, /server_info, /load,
/tokenize) stays on httpx (`replicas.py`, `app.py`).

With prefill replicas (P/D, `pd.py`), the decode replica is chosen first; a long uncached prompt
is then computed on a prefill replica (`_handoff`: retried on another one, else given up for a
local prefill) and the decode replica gets the request with the handoff's `kv_transfer_params`.
Its retries reuse the same handoff: any decode replica can pull the blocks while the lease holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import Response
from starlette.types import Receive, Scope, Send

from kvserve.logger import logger
from kvserve.router.args import MAX_LOCAL_PREFILL_TOKENS
from kvserve.router.index import usable_blocks
from kvserve.router.metrics import RouterMetrics
from kvserve.router.migration import StreamCut, StreamProgress, upstream_body
from kvserve.router.pd import LOCAL, Handoff, handoff_params, prefill_body, wants_remote_prefill
from kvserve.router.policy import Decision, Policy
from kvserve.router.replicas import Flight, Replica, ReplicaSet
from kvserve.router.request import RoutedRequest, block_keys, client_salt
from kvserve.router.tokenizer import RouterTokenizer
from kvserve.server.errors import APIError
from kvserve.server.kv_transfer import release_in_background
from kvserve.server.sse import DONE, EventSourceResponse

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
_END = object()
# what a failed exchange with a replica raises: the connection (refused, reset, cut), a timeout
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


@dataclass
class Reply:
    """A replica's whole answer, read."""

    status: int
    body: bytes
    headers: Mapping[str, str]

    @classmethod
    async def read(cls, response: aiohttp.ClientResponse) -> Reply:
        return cls(response.status, await response.read(), response.headers)


class Retry(Exception):
    """This replica could not take the request; another may."""

    def __init__(self, reason: str, response: Reply | None = None):
        super().__init__(reason)
        self.reason, self.response = reason, response


class Refused(Exception):
    """The replica answered with the client's error (4xx): pass it on."""

    def __init__(self, response: Reply):
        super().__init__(response.status)
        self.response = response


# one try of a request on the replica decided, with the prompt's way there: its answer, or Retry / Refused
Attempt = Callable[[Decision, Handoff], Awaitable[Response]]


class Upstream:
    """A replica's event stream, read by a task of its own so that a health check can cut it."""

    def __init__(self, replica: Replica, decision: Decision, response: aiohttp.ClientResponse, flight: Flight):
        self.replica, self.decision, self.response, self.flight = replica, decision, response, flight
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump())
        flight.abort = self._task.cancel

    async def _pump(self) -> None:
        try:
            async for line in self.response.content:
                if line.startswith(b"data: "):
                    self._queue.put_nowait(line[len(b"data: ") :].rstrip(b"\r\n").decode())
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            self._queue.put_nowait(StreamCut("its replica was found dead"))
        except Exception as e:  # reset, incomplete chunked body, ...
            self._queue.put_nowait(e)
        finally:
            self.response.release()  # back to the pool once read to the end, else closed

    async def next(self) -> str:
        item = await self._queue.get()
        if item is _END:
            raise StreamCut("the stream ended without [DONE]")
        if isinstance(item, Exception):
            raise item
        return item

    def stop(self) -> None:
        """Stop reading; its task closes the response (nothing to await: a cancelled caller cannot skip it)."""
        self._task.cancel()


@dataclass
class Relay:
    """The upstream a client's stream is reading now (another one after a migration)."""

    upstream: Upstream
    first: str | None


class RelayResponse(EventSourceResponse):
    """Releases the relay's upstream however the response ends, even if its body never started."""

    def __init__(
        self, events: AsyncIterator[str], relay: Relay, release: Callable[[Upstream], None], headers: dict[str, str]
    ):
        super().__init__(events, headers=headers)
        self.relay, self.release = relay, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release(self.relay.upstream)  # the one of the moment: after a migration, not the first


class Proxy:
    def __init__(
        self,
        replicas: ReplicaSet,
        policy: Policy,
        metrics: RouterMetrics,
        secret: bytes,
        request_timeout: float,
        tokenizer: RouterTokenizer | None = None,
        max_local_prefill_tokens: int = MAX_LOCAL_PREFILL_TOKENS,
    ):
        self.replicas, self.policy, self.metrics = replicas, policy, metrics
        self.secret = secret
        self.request_timeout = request_timeout
        self.max_local_prefill_tokens = max_local_prefill_tokens
        self.tokenizer = tokenizer  # set once discovered; decodes a migrated stream's tokens
        self.session: aiohttp.ClientSession | None = None  # made by start(), in the event loop

    async def start(self) -> None:
        # 2 s to connect (a dead host fails fast); request_timeout for a pool slot and for each read
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.request_timeout, sock_connect=2.0, sock_read=self.request_timeout
        )
        self.session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=4096))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def _session(self) -> aiohttp.ClientSession:
        assert self.session is not None, "Proxy.start() first"
        return self.session

    def choose(self, request: RoutedRequest, exclude: set[int]) -> Decision | None:
        started = time.perf_counter()
        candidates = self.replicas.candidates(exclude)
        decision = self.policy.choose(request, candidates)
        self.metrics.decision_seconds.observe(time.perf_counter() - started)
        return decision

    async def forward(self, request: RoutedRequest) -> Response:
        return await (self._stream(request) if request.stream else self._complete(request))

    # whole responses

    async def _complete(self, request: RoutedRequest) -> Response:
        async def attempt(decision: Decision, handoff: Handoff) -> Response:
            response = await self._post(decision, request, handoff.apply(request.body))
            self._record_usage(decision, request, json.loads(response.body).get("usage"))
            return _passed_on(response, decision)

        return await self._route(request, attempt)

    async def _route(self, request: RoutedRequest, attempt: Attempt) -> Response:
        """Replica after replica until `attempt` gets an answer from one: a `Retry` tries the next, a
        `Refused` is the client's answer. With P/D the prompt is handed off once, for every attempt; a
        handoff no replica took is released."""
        exclude: set[int] = set()
        last: Reply | None = None
        handoff: Handoff | None = None
        try:
            while (decision := self.choose(request, exclude)) is not None:
                if handoff is None:
                    handoff = await self._handoff(request, decision)
                decision = _decoding(decision, request, handoff)
                try:
                    return await attempt(decision, handoff)
                except Retry as e:
                    exclude.add(decision.replica.index)
                    last = e.response or last
                    self.metrics.retries.labels(e.reason).inc()
                except Refused as e:
                    self._give_up(handoff)
                    return _passed_on(e.response, decision)
        except asyncio.CancelledError:  # the client left
            self._give_up(handoff)
            raise
        self._give_up(handoff)
        return _passed_on(last, None) if last is not None else _unavailable()

    async def _post(self, decision: Decision, request: RoutedRequest, body: dict[str, Any]) -> Reply:
        r = decision.replica
        flight = self._start_flight(decision, request)
        task = asyncio.ensure_future(self._fetch(f"{r.url}{PATHS[request.kind]}", body, _headers(request)))
        flight.abort = task.cancel
        try:
            await asyncio.wait({task})
        finally:
            task.cancel()  # the client left: so does the replica's request
            self._end_flight(r, flight)
        if task.cancelled():
            raise Retry("replica_dead")
        try:
            response = task.result()
        except TRANSPORT_ERRORS as e:
            raise self._transport_failed(r, e) from e
        return self._check_status(r, response)

    async def _fetch(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> Reply:
        async with self._session().post(url, json=body, headers=headers) as response:
            return await Reply.read(response)

    def _check_status(self, r: Replica, response: Reply) -> Reply:
        if response.status >= 500:
            self.replicas.failed(r, f"HTTP {response.status}")
            raise Retry("server_error", response)
        if response.status == 429:
            raise Retry("queue_full", response)
        if response.status != 200:
            raise Refused(response)
        self.replicas.succeeded(r)
        return response

    def _transport_failed(self, r: Replica, error: Exception) -> Retry:
        """Refused or reset: the replica is out at once. A timeout: maybe only busy (or this router starved
        of CPU); the request goes elsewhere and the health checks decide."""
        if refused_or_reset(error):
            self.replicas.connection_failed(r, error)
            return Retry("connection")
        return Retry("timeout")

    # prefill/decode disaggregation

    async def _handoff(self, request: RoutedRequest, decode: Decision) -> Handoff:
        """The prompt's KV from a prefill replica for `decode`, or LOCAL: the decode replica computes it."""
        reason = wants_remote_prefill(request, decode, self.max_local_prefill_tokens)
        if reason is not None:
            self.metrics.local_prefills.labels(reason).inc()
            return LOCAL
        body = prefill_body(request)
        exclude: set[int] = set()
        failure = None
        while candidates := self.replicas.prefill_candidates(exclude):
            started = time.perf_counter()
            prefill = self.policy.choose(request, candidates)
            self.metrics.decision_seconds.observe(time.perf_counter() - started)
            assert prefill is not None
            try:
                reply = await self._post(prefill, request, body)
            except Retry as e:  # refused, reset, 5xx, 429, timeout, found dead: the next prefill replica
                exclude.add(prefill.replica.index)
                failure = e.reason
                self.metrics.retries.labels(e.reason).inc()
                continue
            except Refused as e:  # the client's error: the decode replica answers it as its own
                failure = f"http_{e.response.status}"
                break
            try:
                answer = json.loads(reply.body)
            except ValueError:
                answer = None
            params = handoff_params(answer)
            if params is None:  # it could not hold the blocks
                failure = "no_handoff"
                break
            self._record_usage(prefill, request, answer.get("usage"))
            self.metrics.remote_prefills.labels(prefill.replica.url).inc()
            return Handoff(params, prefill)
        if failure is None:
            self.metrics.local_prefills.labels("no_prefill_replica").inc()
        else:
            logger.warning("router: remote prefill failed (%s): the decode replica prefills itself", failure)
            self.metrics.prefill_fallbacks.labels(failure).inc()
            self.metrics.local_prefills.labels("fallback").inc()
        return LOCAL

    def _give_up(self, handoff: Handoff | None) -> None:
        """No decode replica answered with the handed-off prompt: the prefill replica's lease is released
        now (a decode replica that did pull released it already; releasing twice is harmless)."""
        if handoff is not None and handoff.params is not None:
            release_in_background(handoff.params, self.secret)

    # streams

    async def _stream(self, request: RoutedRequest) -> Response:
        progress = StreamProgress(request, self.tokenizer)
        body = upstream_body(request)
        exclude: set[int] = set()  # the replicas a migration of this stream must not go back to

        async def attempt(decision: Decision, handoff: Handoff) -> Response:
            try:
                upstream, first = await self._open(decision, request, PATHS[request.kind], handoff.apply(body))
            except Retry:
                exclude.add(decision.replica.index)
                raise
            relay = Relay(upstream, first)  # its first event: the decode replica has pulled the blocks
            events = self._relay(request, progress, relay, exclude)
            return RelayResponse(events, relay, self._release, _routing_headers(decision))

        return await self._route(request, attempt)

    async def _open(
        self, decision: Decision, request: RoutedRequest, path: str, body: dict[str, Any]
    ) -> tuple[Upstream, str]:
        """The upstream stream and its first event (so that nothing is promised to the client before it)."""
        r = decision.replica
        flight = self._start_flight(decision, request)
        upstream = None
        try:
            try:
                response = await self._session().post(f"{r.url}{path}", json=body, headers=_headers(request))
                if response.status != 200:
                    try:
                        self._check_status(r, await Reply.read(response))  # raises: not 200
                    finally:
                        response.release()
            except TRANSPORT_ERRORS as e:
                raise self._transport_failed(r, e) from e
            upstream = Upstream(r, decision, response, flight)
            try:
                first = await upstream.next()
            except (StreamCut, *TRANSPORT_ERRORS) as e:
                self._cut(upstream, e)
                raise Retry("cut_before_first_event") from e
        except BaseException:  # cancelled too: the flight must not outlive the attempt
            self._end_flight(r, flight)
            if upstream is not None:
                upstream.stop()
            raise
        flight.started = True
        return upstream, first

    async def _relay(
        self, request: RoutedRequest, progress: StreamProgress, relay: Relay, exclude: set[int]
    ) -> AsyncIterator[str]:
        while True:
            upstream = relay.upstream
            try:
                data, relay.first = relay.first or await upstream.next(), None
                upstream.flight.generated += 1
                events = progress.accept(data)
            except (StreamCut, *TRANSPORT_ERRORS, ValueError) as e:
                self._cut(upstream, e)
                exclude.add(upstream.replica.index)
                if request.migratable and progress.finished:  # cut after its last token: only the end is lost
                    if (usage := progress.final_usage()) is not None:
                        yield f"data: {usage}\n\n"
                    yield DONE
                    return
                moved = await self._migrate(request, progress, exclude) if request.migratable else None
                if moved is None:
                    yield _error_event("the replica serving this stream failed")
                    yield DONE
                    return
                relay.upstream, relay.first = moved
                continue
            if progress.done:  # before the last yield: the client may close the connection on [DONE]
                self._stream_finished(upstream, request, progress)
            for event in events:
                yield f"data: {event}\n\n"
            if progress.done:  # [DONE], or a stop string the router matched (its upstream is closed then)
                return

    def _cut(self, upstream: Upstream, error: Exception) -> None:
        r = upstream.replica
        logger.warning("router: stream on replica %d (%s) cut: %s", r.index, r.url, error or type(error).__name__)
        if refused_or_reset(error):
            self.replicas.connection_failed(r, error)
        elif isinstance(error, StreamCut):
            self.replicas.failed(r, str(error))
        self._release(upstream)

    def _release(self, upstream: Upstream) -> None:
        self._end_flight(upstream.replica, upstream.flight)
        upstream.stop()

    async def _migrate(
        self, request: RoutedRequest, progress: StreamProgress, exclude: set[int]
    ) -> tuple[Upstream, str] | None:
        """Continue the stream on the best other replica; None if none would."""
        while True:
            body = progress.continuation_body()
            prompt = body["prompt"]
            keys = block_keys([prompt], self._block_size(), self.secret, request.tenant, client_salt(request.body))
            moved = RoutedRequest("completion", body, request.tenant, request.authorization, [prompt], keys)
            decision = self.choose(moved, exclude)
            if decision is None:
                self.metrics.migrations.labels("failed").inc()
                logger.error("router: no replica to continue a cut stream on")
                return None
            try:
                upstream, first = await self._open(decision, moved, PATHS["completion"], body)
            except Retry:
                exclude.add(decision.replica.index)
                continue
            except Refused as e:
                self.metrics.migrations.labels("failed").inc()
                logger.error("router: the continuation of a cut stream was refused: HTTP %d", e.response.status_code)
                return None
            self.metrics.migrations.labels("ok").inc()
            logger.info(
                "router: stream continued on replica %d after %d tokens",
                decision.replica.index,
                progress.continuation.base_tokens if progress.continuation else 0,
            )
            return upstream, first

    def _stream_finished(self, upstream: Upstream, request: RoutedRequest, progress: StreamProgress) -> None:
        self.replicas.succeeded(upstream.replica)
        if progress.continuation is None:  # a continuation's prompt is not the one predicted for
            self._record_usage(upstream.decision, request, progress.usage)

    async def pass_on(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        """A request any replica answers alike (/tokenize, /detokenize): to the least loaded one."""
        for r in sorted(self.replicas.routable(), key=lambda r: r.load_tokens()):
            try:
                async with self._session().post(f"{r.url}{path}", data=body, headers=headers) as response:
                    reply = await Reply.read(response)
            except TRANSPORT_ERRORS as e:
                if refused_or_reset(e):
                    self.replicas.connection_failed(r, e)
                continue
            if reply.status < 500:
                return Response(reply.body, reply.status, media_type=reply.headers.get("content-type"))
        return _unavailable()

    # bookkeeping

    def _start_flight(self, decision: Decision, request: RoutedRequest) -> Flight:
        r = decision.replica
        flight = Flight(request.num_prompt_tokens, decision.uncached_tokens)
        r.add_flight(flight)
        for keys in request.keys:
            r.sent.record(keys)
        self.metrics.routed.labels(r.url).inc()
        self.metrics.in_flight.labels(r.url).set(len(r.flights))
        return flight

    def _end_flight(self, r: Replica, flight: Flight) -> None:
        r.end_flight(flight)
        self.metrics.in_flight.labels(r.url).set(len(r.flights))

    def _record_usage(self, decision: Decision, request: RoutedRequest, usage: dict[str, Any] | None) -> None:
        r = decision.replica
        if usage is None or not request.prompts:
            return
        reported = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.metrics.cached_tokens(r, decision.predicted_cached_tokens, reported)
        if sum(len(k) for k in request.keys) * self._block_size() > decision.predicted_cached_tokens:
            r.expect_events(request.arrived)  # its blocks were stored after it arrived

    def _block_size(self) -> int:
        info = self.replicas.info()
        return info.block_size if info else 1


def _decoding(decision: Decision, request: RoutedRequest, handoff: Handoff) -> Decision:
    """The decode replica's decision once the prompt's way there is known. Handed off, it has no prefill to
    queue (only the last token, recomputed) and finds every whole block but the last token's cached (pulled
    into its handoff tier, which its prefix lookup reads first)."""
    if handoff.params is None:
        return decision
    bs = decision.replica.info.block_size if decision.replica.info else 1
    cached = sum(usable_blocks(len(p), bs) * bs for p in request.prompts)
    return dataclasses.replace(decision, predicted_cached_tokens=cached, uncached_tokens=0)


def refused_or_reset(error: Exception) -> bool:
    """The connection was refused, reset or cut short (not a timeout: that may be a busy replica)."""
    cut = (aiohttp.ClientOSError, aiohttp.ClientConnectionResetError, aiohttp.ServerDisconnectedError)
    cut += (aiohttp.ClientPayloadError,)
    return isinstance(error, cut) and not isinstance(error, TimeoutError)


def _headers(request: RoutedRequest) -> dict[str, str]:
    return {"authorization": request.authorization} if request.authorization else {}


def _routing_headers(decision: Decision | None) -> dict[str, str]:
    """Which replica answered (its place in --replica) and the cached tokens the router expected there."""
    if decision is None:
        return {}
    return {
        "x-kvserve-replica": str(decision.replica.index),
        "x-kvserve-predicted-cached-tokens": str(decision.predicted_cached_tokens),
    }


def _passed_on(response: Reply, decision: Decision | None) -> Response:
    headers = _routing_headers(decision)
    if "retry-after" in response.headers:
        headers["retry-after"] = response.headers["retry-after"]
    media_type = response.headers.get("content-type", "application/json")
    return Response(response.body, status_code=response.status, media_type=media_type, headers=headers)


def _unavailable() -> Response:
    raise APIError(503, "no replica is available", type="server_error", code="no_replica")


def _error_event(message: str) -> str:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(error)}\n\n"
