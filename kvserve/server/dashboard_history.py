"""The dashboard's last minutes: one sample a second of throughput, latency, queues and hit rate.

Sampled on the event loop from what `/metrics` reads (the engine's `load()` and the latency
histograms), so a chart and a scrape agree; kept whether or not anyone watches, so a page
opened now shows the minutes before it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import Histogram

from kvserve.engine.client import EngineClient, EngineLoad
from kvserve.server.metrics import ServerMetrics

INTERVAL = 1.0  # seconds between samples
KEEP = 300  # samples: the last five minutes


@dataclass(frozen=True)
class Totals:
    """Cumulative counters at one moment."""

    time: float  # time.time()
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    ttft_count: float
    ttft_sum: float
    itl_count: float
    itl_sum: float


@dataclass(frozen=True)
class Sample:
    """One second: rates over it, and the gauges at its end."""

    t: float
    prompt_tps: float
    generation_tps: float
    ttft: float | None  # mean of the first tokens in this second; None when none came
    itl: float | None
    hit_rate: float | None  # of the tokens looked up in this second
    preemptions: int
    running: int
    waiting: int
    kv_usage: float


def histogram_totals(histogram: Histogram) -> tuple[float, float]:
    """(count, sum) of a histogram, as /metrics renders them."""
    values = {s.name.rsplit("_", 1)[-1]: s.value for m in histogram.collect() for s in m.samples}
    return values.get("count", 0.0), values.get("sum", 0.0)


class DashboardHistory:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.totals: deque[Totals] = deque(maxlen=KEEP + 1)
        self.samples: deque[Sample] = deque(maxlen=KEEP)

    def read_totals(self, load: EngineLoad) -> Totals:
        stats = load.totals
        ttft = histogram_totals(self.metrics.latency.ttft)
        itl = histogram_totals(self.metrics.latency.itl)
        return Totals(
            time.time(),
            stats.prompt_tokens,
            stats.generation_tokens,
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
            stats.num_preemptions,
            *ttft,
            *itl,
        )

    def sample(self) -> None:
        load = self.engine.load()
        now = self.read_totals(load)
        if self.totals:
            self.samples.append(_rates(self.totals[-1], now, load.num_running, load.num_waiting, load.kv_cache_usage))
        self.totals.append(now)

    async def run(self) -> None:
        self.sample()
        while True:
            await asyncio.sleep(INTERVAL)
            self.sample()

    def window_hit_rate(self, queries: int, hits: int) -> float | None:
        """Device-pool hit rate from the oldest kept second to counters `queries`, `hits` (now)."""
        if not self.totals:
            return None
        first = self.totals[0]
        looked_up = queries - first.prefix_queries
        return (hits - first.prefix_hits) / looked_up if looked_up > 0 else None

    def to_json(self) -> dict[str, Any]:
        """Column-wise, as the page draws them."""
        columns: dict[str, list[Any]] = {name: [] for name in Sample.__dataclass_fields__}
        for s in self.samples:
            for name, value in asdict(s).items():
                columns[name].append(value)
        window = self.totals[-1].time - self.totals[0].time if len(self.totals) > 1 else 0.0
        return {"interval": INTERVAL, "window_s": round(window, 3), **columns}


def _rates(a: Totals, b: Totals, running: int, waiting: int, kv_usage: float) -> Sample:
    dt = max(b.time - a.time, 1e-9)
    ttft_n, itl_n = b.ttft_count - a.ttft_count, b.itl_count - a.itl_count
    queries = b.prefix_queries - a.prefix_queries
    return Sample(
        t=b.time,
        prompt_tps=(b.prompt_tokens - a.prompt_tokens) / dt,
        generation_tps=(b.generation_tokens - a.generation_tokens) / dt,
        ttft=(b.ttft_sum - a.ttft_sum) / ttft_n if ttft_n else None,
        itl=(b.itl_sum - a.itl_sum) / itl_n if itl_n else None,
        hit_rate=(b.prefix_hits - a.prefix_hits) / queries if queries else None,
        preemptions=b.preemptions - a.preemptions,
        running=running,
        waiting=waiting,
        kv_usage=kv_usage,
    )
