"""Engine statistics: the last step and running totals (the server publishes them)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvserve.engine.request import Request
from kvserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from kvserve.outputs import RequestOutput


@dataclass
class StepStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int  # free and not cached
    kv_blocks_evictable: int  # cached, unreferenced: matchable until an allocation needs them
    num_batched_tokens: int
    num_prefill_tokens: int  # prompt tokens (and recomputed ones after a preemption)
    num_decode_tokens: int
    num_preempted: int
    kv_slots_allocated: int  # block_size x blocks in use
    kv_slots_unused: int  # allocated but not (yet) holding a token: the tails of last blocks
    step_time: float


@dataclass
class EngineStats:
    num_steps: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompts of requests that produced their first token
    generation_tokens: int = 0
    prefill_tokens_computed: int = 0  # includes recomputation after preemption
    finished_requests: Counter[str] = field(default_factory=Counter)  # user requests, by first sample's reason
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of those, found cached in the device pool
    external_prefix_cache_queries: int = 0  # tokens looked up in the KV tiers (after the device hit)
    external_prefix_cache_hits: int = 0  # of those, loaded from a tier (`kvserve:kv_tier_hits` says which)
    prefix_cache_evictions: int = 0  # blocks
    prefix_cache_blocks: int = 0  # cached now (in use or evictable)
    peak_kv_blocks_used: int = 0
    peak_running: int = 0
    kv_slots_allocated_sum: int = 0  # summed over steps: waste = unused / allocated
    kv_slots_unused_sum: int = 0
    last_step: StepStats | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def kv_waste(self) -> float:
        return self.kv_slots_unused_sum / self.kv_slots_allocated_sum if self.kv_slots_allocated_sum else 0.0

    def record_step(
        self,
        scheduler: Scheduler,
        out: SchedulerOutput,
        updated: list[Request],
        outputs: list[RequestOutput],
        step_time: float,
    ) -> None:
        pool = scheduler.kv.pool
        prefill = out.num_batched_tokens - sum(1 for s in out.scheduled if _is_decode(s))
        allocated, unused = _kv_slot_usage(scheduler)
        step = StepStats(
            num_running=len(scheduler.running),
            num_waiting=scheduler.num_waiting,
            kv_blocks_used=pool.num_used_blocks,
            kv_blocks_free=pool.num_free_blocks,
            kv_blocks_evictable=pool.num_evictable_blocks,
            num_batched_tokens=out.num_batched_tokens,
            num_prefill_tokens=prefill,
            num_decode_tokens=out.num_batched_tokens - prefill,
            num_preempted=len(out.preempted),
            kv_slots_allocated=allocated,
            kv_slots_unused=unused,
            step_time=step_time,
        )
        self.last_step = step
        self.num_steps += 1
        self.num_preemptions += step.num_preempted
        self.prefill_tokens_computed += prefill
        self.generation_tokens += len(updated)
        first_tokens = [r for r in updated if r.num_output_tokens == 1 and r.sample_index == 0]
        self.prompt_tokens += sum(r.num_prompt_tokens for r in first_tokens)
        self.finished_requests.update(o.outputs[0].finish_reason for o in outputs if o.finished)
        self._record_prefix_cache(scheduler)
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, step.kv_blocks_used)
        self.peak_running = max(self.peak_running, len(out.scheduled))
        self.kv_slots_allocated_sum += allocated
        self.kv_slots_unused_sum += unused

    def _record_prefix_cache(self, scheduler: Scheduler) -> None:
        kv = scheduler.kv
        p = kv.prefix_stats
        self.prefix_cache_queries, self.prefix_cache_hits = p.queries, p.hits
        self.external_prefix_cache_queries, self.external_prefix_cache_hits = p.external_queries, p.external_hits
        if kv.prefix_cache is not None:
            self.prefix_cache_evictions = kv.prefix_cache.num_evictions
            self.prefix_cache_blocks = kv.prefix_cache.size_info().cached_blocks


def _is_decode(s: ScheduledRequest) -> bool:
    """One token for a request that already had output before this step (stats run after the update)."""
    return s.num_new_tokens == 1 and s.request.num_output_tokens - int(s.samples) > 0


def _kv_slot_usage(scheduler: Scheduler) -> tuple[int, int]:
    """Only the last block of a table can be partly filled; shared tails are counted once."""
    kv = scheduler.kv
    tails: dict[int, int] = {}
    for req in scheduler.running:
        table = kv.block_tables.get(req.seq_id)
        if table:
            tails[table[-1].block_id] = len(table) * kv.block_size - req.num_computed_tokens
    return kv.pool.num_used_blocks * kv.block_size, sum(tails.values())
