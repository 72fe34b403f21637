"""The router's Prometheus metrics (`kvserve:router_*`), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.router.replicas import Replica, State

_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_TOKENIZE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("kvserve:router_requests_routed", "Requests sent to a replica.", ["replica"], registry=r)
        self.predicted_cached = Counter(
            "kvserve:router_predicted_cached_tokens",
            "Prompt tokens the router expected the replica to find cached.",
            ["replica"],
            registry=r,
        )
        self.reported_cached = Counter(
            "kvserve:router_reported_cached_tokens",
            "Prompt tokens the replica reported cached (usage.prompt_tokens_details.cached_tokens).",
            ["replica"],
            registry=r,
        )
        self.mispredicted = Counter(
            "kvserve:router_cached_tokens_mispredicted",
            "Requests whose reported cached tokens differed from the prediction.",
            ["replica"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvserve:router_decision_seconds",
            "Time to score the replicas and choose one (tokenizing not included).",
            registry=r,
            buckets=_DECISION_BUCKETS,
        )
        self.tokenize_seconds = Histogram(
            "kvserve:router_tokenize_seconds",
            "Time to turn a request into token ids and block keys.",
            registry=r,
            buckets=_TOKENIZE_BUCKETS,
        )
        self.tokenize_fallbacks = Counter(
            "kvserve:router_tokenize_fallbacks", "Requests tokenized by a replica's /tokenize.", registry=r
        )
        self.retries = Counter(
            "kvserve:router_retries", "Requests sent again to another replica before streaming.", ["reason"], registry=r
        )
        self.migrations = Counter(
            "kvserve:router_migrations", "Streams cut mid-way and continued on another replica.", ["result"], registry=r
        )
        self.remote_prefills = Counter(
            "kvserve:router_remote_prefills",
            "Requests whose prompt a prefill replica computed and handed to their decode replica (P/D).",
            ["replica"],
            registry=r,
        )
        self.local_prefills = Counter(
            "kvserve:router_local_prefills",
            "Requests whose replica computed their prompt itself: short (few tokens uncached there), "
            "batch (several prompts), beam_search, no_prefill_replica (none healthy and free), "
            "fallback (a remote prefill failed).",
            ["reason"],
            registry=r,
        )
        self.prefill_fallbacks = Counter(
            "kvserve:router_prefill_fallbacks",
            "Remote prefills given up for a local one, by why the last prefill replica tried failed.",
            ["reason"],
            registry=r,
        )
        self.state_changes = Counter(
            "kvserve:router_replica_state_changes", "Replica state changes.", ["replica", "state"], registry=r
        )
        self.up = Gauge("kvserve:router_replica_up", "1 while the replica is routable.", ["replica"], registry=r)
        self.in_flight = Gauge("kvserve:router_in_flight", "Requests in flight.", ["replica"], registry=r)

    def replica_state(self, replica: Replica, state: State, reason: str) -> None:
        self.state_changes.labels(replica.url, state.value).inc()
        self.up.labels(replica.url).set(1 if state is State.HEALTHY else 0)

    def cached_tokens(self, replica: Replica, predicted: int, reported: int) -> None:
        self.predicted_cached.labels(replica.url).inc(predicted)
        self.reported_cached.labels(replica.url).inc(reported)
        if predicted != reported:
            self.mispredicted.labels(replica.url).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
