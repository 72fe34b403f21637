"""A log line every few seconds while the engine is busy: throughput, queue, KV cache, prefix hits."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvserve.engine.client import EngineClient
from kvserve.logger import logger


@dataclass
class _Totals:
    time: float
    prompt_tokens: int
    generation_tokens: int
    queries: int
    hits: int


class StatsLogger:
    def __init__(self, engine: EngineClient, interval: float = 5.0):
        self.engine = engine
        self.interval = interval
        self._last = self._totals()

    def _totals(self) -> _Totals:
        s = self.engine.load().totals
        return _Totals(
            time.monotonic(), s.prompt_tokens, s.generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log()

    def log(self) -> None:
        """Log what happened since the last line; nothing when the engine was idle throughout."""
        now, last = self._totals(), self._last
        load = self.engine.load()
        self._last = now
        progressed = (now.prompt_tokens, now.generation_tokens) != (last.prompt_tokens, last.generation_tokens)
        if not (progressed or load.num_running or load.num_waiting):
            return
        elapsed = max(now.time - last.time, 1e-9)
        queries = now.queries - last.queries
        hit_rate = (now.hits - last.hits) / queries if queries else 0.0
        tiers = ", ".join(f"{t.name} {t.served_blocks * load.block_size}" for t in load.kv_tiers)
        logger.info(
            "prompt throughput: %.1f tokens/s, generation throughput: %.1f tokens/s, running: %d, waiting: %d, "
            "KV cache usage: %.1f%%, prefix cache hit rate: %.1f%%%s",
            (now.prompt_tokens - last.prompt_tokens) / elapsed,
            (now.generation_tokens - last.generation_tokens) / elapsed,
            load.num_running,
            load.num_waiting,
            100 * load.kv_cache_usage,
            100 * hit_rate,
            f", tokens loaded from KV tiers so far: {tiers}" if tiers else "",
        )
