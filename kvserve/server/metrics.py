"""Prometheus metrics, named as vLLM's with a `kvserve:` prefix, in a registry per server.

Engine counters and gauges are read from the engine's `load()` at scrape time (so an
abort that freed blocks shows at once); latency
histograms are fed by an `on_step` hook in the engine thread; per-tenant counters
by the request handlers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.client import EngineClient
from kvserve.kv_cache.tiers.store import LOAD_BUCKETS, TierSnapshot
from kvserve.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# fmt: off
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                          2.5, 5.0, 7.5, 10.0)
# fmt: on


class EngineCollector(Collector):
    """Gauges and counters of the engine, read when scraped."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load()
        stats = load.totals
        yield _gauge("num_requests_running", "Sequences running on the engine.", load.num_running)
        yield _gauge("num_requests_waiting", "Requests waiting to be scheduled.", load.num_waiting)
        yield _gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.", load.kv_cache_usage)
        yield _counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield _counter(
            "external_prefix_cache_queries",
            "Prompt tokens looked up in the KV tiers (host RAM, disk, Redis).",
            stats.external_prefix_cache_queries,
        )
        yield _counter(
            "external_prefix_cache_hits", "Prompt tokens loaded from the KV tiers.", stats.external_prefix_cache_hits
        )
        yield _counter("prefix_cache_evictions", "Blocks evicted from the prefix cache.", stats.prefix_cache_evictions)
        yield from _tier_metrics(load.kv_tiers, load.block_size)
        yield _counter("num_preemptions", "Preemptions of running requests.", stats.num_preemptions)
        yield _gauge("kv_leases", "Prompts whose blocks this replica holds for a decode replica.", load.kv_leases)
        yield _counter("kv_lease_expiries", "Leases run out unpulled.", load.kv_lease_expiries)
        yield _counter("prompt_tokens", "Prefill tokens of requests that produced a token.", stats.prompt_tokens)
        yield _counter("generation_tokens", "Generated tokens.", stats.generation_tokens)
        success = CounterMetricFamily(
            "kvserve:request_success", "Finished requests, by finish reason.", labels=["finished_reason"]
        )
        for reason, count in sorted(dict(stats.finished_requests).items()):
            success.add_metric([reason], count)
        yield success


def _tier_metrics(tiers: list[TierSnapshot], block_size: int) -> Iterator[Metric]:
    """One series per configured tier (label `tier`: host, disk, redis, redis-cluster)."""
    counters = {
        "kv_tier_queries": ("Tokens looked up in the tier.", lambda t: t.queried_blocks * block_size),
        "kv_tier_hits": ("Tokens the tier delivered to requests.", lambda t: t.served_blocks * block_size),
        "kv_tier_read_bytes": ("Bytes read from the tier.", lambda t: t.read_bytes),
        "kv_tier_written_bytes": ("Bytes written to the tier.", lambda t: t.written_bytes),
        "kv_tier_stored_blocks": ("Blocks written to the tier.", lambda t: t.stored_blocks),
        "kv_tier_dropped_writes": ("Blocks not written (tier aside, queue full).", lambda t: t.dropped_writes),
    }
    for name, (doc, value) in counters.items():
        family = CounterMetricFamily(f"kvserve:{name}", doc, labels=["tier"])
        for t in tiers:
            family.add_metric([t.name], value(t))
        yield family
    gauges = {
        "kv_tier_usage_bytes": ("Bytes the tier holds.", lambda t: t.used_bytes),
        "kv_tier_capacity_bytes": ("The tier's size cap (0: none of its own).", lambda t: t.capacity_bytes or 0),
        "kv_tier_breaker_state": ("0 closed, 1 open (tier aside), 2 half-open.", lambda t: t.breaker_state),
    }
    for name, (doc, value) in gauges.items():
        family = GaugeMetricFamily(f"kvserve:{name}", doc, labels=["tier"])
        for t in tiers:
            family.add_metric([t.name], value(t))
        yield family
    errors = CounterMetricFamily("kvserve:kv_tier_errors", "Tier errors, by kind.", labels=["tier", "kind"])
    latency = HistogramMetricFamily("kvserve:kv_tier_load_seconds", "Time of one batched read.", labels=["tier"])
    for t in tiers:
        for kind, n in sorted(t.errors.items()):
            errors.add_metric([t.name, kind], n)
        cumulative = list(itertools.accumulate(t.load_seconds.counts))
        buckets = [(str(b), c) for b, c in zip(LOAD_BUCKETS, cumulative, strict=False)] + [("+Inf", cumulative[-1])]
        latency.add_metric([t.name], buckets, t.load_seconds.total)
    yield errors
    yield latency
    yield from _shard_metrics(tiers, block_size)


def _shard_metrics(tiers: list[TierSnapshot], block_size: int) -> Iterator[Metric]:
    """One series per shard of a sharded tier (label `shard`: a Redis Cluster master's host:port);
    families of their own, so that summing a tier's series never counts a block twice."""
    counters = {
        "kv_tier_shard_queries": ("Tokens looked up on the shard.", lambda s: s.queries * block_size),
        "kv_tier_shard_hits": ("Tokens found on the shard.", lambda s: s.hits * block_size),
        "kv_tier_shard_read_bytes": ("Bytes read from the shard.", lambda s: s.read_bytes),
        "kv_tier_shard_written_bytes": ("Bytes written to the shard.", lambda s: s.written_bytes),
    }
    for name, (doc, value) in counters.items():
        family = CounterMetricFamily(f"kvserve:{name}", doc, labels=["tier", "shard"])
        for t in tiers:
            for s in t.shards:
                family.add_metric([t.name, s.name], value(s))
        yield family
    state = GaugeMetricFamily(
        "kvserve:kv_tier_shard_breaker_state", "0 closed, 1 open (shard aside), 2 half-open.", labels=["tier", "shard"]
    )
    errors = CounterMetricFamily(
        "kvserve:kv_tier_shard_errors", "Shard errors, by kind.", labels=["tier", "shard", "kind"]
    )
    for t in tiers:
        for s in t.shards:
            state.add_metric([t.name, s.name], s.breaker_state)
            for kind, n in sorted(s.errors.items()):
                errors.add_metric([t.name, s.name, kind], n)
    yield state
    yield errors


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"kvserve:{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"kvserve:{name}", doc, value=value)


class LatencyObserver:
    """The engine's `on_step` hook: time to first token, inter-token, end-to-end and queue latencies."""

    def __init__(self, engine: EngineClient, registry: CollectorRegistry):
        self.engine = engine
        self.last_token: dict[str, float] = {}  # request id -> when its last token came (engine thread only)
        self.ttft = Histogram(
            "kvserve:time_to_first_token_seconds", "Time to first token.", registry=registry, buckets=_LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "kvserve:inter_token_latency_seconds",
            "Time between tokens of a request.",
            registry=registry,
            buckets=_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "kvserve:e2e_request_latency_seconds", "Arrival to finish.", registry=registry, buckets=_LATENCY_BUCKETS
        )
        self.queue = Histogram(
            "kvserve:request_queue_time_seconds",
            "Arrival to first scheduled.",
            registry=registry,
            buckets=_LATENCY_BUCKETS,
        )

    def __call__(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            self._observe(out, now)
        live = self.engine.unfinished_request_ids()
        if len(self.last_token) > len(live):  # aborted requests never finish: forget them
            self.last_token = {rid: t for rid, t in self.last_token.items() if rid in live}

    def _observe(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        previous = self.last_token.get(out.request_id)
        if previous is None and m is not None and m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
            if m.queue_time is not None:
                self.queue.observe(m.queue_time)
        elif previous is not None:
            self.itl.observe(now - previous)
        if out.finished:
            self.last_token.pop(out.request_id, None)
            if m is not None:
                self.e2e.observe(now - m.arrival_time)
        else:
            self.last_token[out.request_id] = now


class ServerMetrics:
    def __init__(self, engine: EngineClient):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.latency = LatencyObserver(engine, self.registry)
        self.tenant_requests = Counter(
            "kvserve:tenant_requests", "Requests (prompts) per tenant.", ["tenant"], registry=self.registry
        )
        self.tenant_cached_tokens = Counter(
            "kvserve:tenant_cached_tokens", "Prompt tokens served from the cache.", ["tenant"], registry=self.registry
        )

        # prefill/decode handoff, direct path (through Redis it is the redis tier's own counters)
        self.kv_transfer_blocks = Counter(
            "kvserve:kv_transfer_blocks", "KV blocks handed off directly.", ["direction"], registry=self.registry
        )
        self.kv_transfer_bytes = Counter(
            "kvserve:kv_transfer_bytes", "Bytes of KV handed off directly.", ["direction"], registry=self.registry
        )
        self.kv_transfer_seconds = Counter(
            "kvserve:kv_transfer_seconds", "Time spent handing KV off.", ["direction"], registry=self.registry
        )
        self.kv_load_failures = Counter(
            "kvserve:kv_load_failures", "Pulls of a prompt's KV from a prefill replica that failed.",
            registry=self.registry,
        )  # fmt: skip

    def kv_transferred(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.kv_transfer_blocks.labels(direction).inc(blocks)
        self.kv_transfer_bytes.labels(direction).inc(nbytes)
        self.kv_transfer_seconds.labels(direction).inc(seconds)

    def value(self, name: str, **labels: str) -> float:
        """A sample of this registry (0 before its first increment), as /metrics would show it."""
        return self.registry.get_sample_value(f"kvserve:{name}", labels) or 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)
