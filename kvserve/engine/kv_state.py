"""A snapshot of the KV cache and the queues, for the dashboard (`GET /debug/kv_state`).

The engine thread takes it (it alone may read the scheduler and the pool) and replaces
`KVStateFeed.latest` with the new, immutable one; readers on other threads only ever see
a whole snapshot. Snapshots are taken only while someone watches: after a step when the
last one is older than `CAPTURE_INTERVAL` (longer for a pool so large that a snapshot
would take more than `CAPTURE_SHARE` of the engine's time), and on request (a command the
engine thread answers between steps, or at once when idle) when the state changed since
the last one and it is not recent.

No snapshot carries a tenant's name, key or salt: a block in use is labelled with a
digest of its request's extra key (itself a digest of the salt), truncated.
"""

from __future__ import annotations

import hashlib
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.kv_cache.tiers.store import TierSnapshot

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.kv_cache.kv_cache_manager import KVCacheManager

CAPTURE_INTERVAL = 0.25  # seconds between snapshots while requests run and someone watches, at least
CAPTURE_SHARE = 0.05  # of the engine thread's time, at most: a large pool is captured less often
WATCH_FOR = 10.0  # seconds after the last read that snapshots keep being taken
FREE, EVICTABLE = ".", ":"  # block codes; a block in use is a tenant's letter (upper case: shared)
TENANT_LETTERS = string.ascii_lowercase  # the last one also stands for every tenant after it
_FREE, _EVICTABLE, _LOWER_A = ord(FREE), ord(EVICTABLE), ord("a")


@dataclass(frozen=True)
class TenantBlocks:
    letter: str  # its blocks' code (upper case where shared)
    digest: str  # 8 hex digits of SHA-256 over the extra key; "none" for requests without one
    blocks: int  # blocks its requests hold (a shared block counted once)


@dataclass(frozen=True)
class KVState:
    taken: float  # time.time()
    step: int  # engine steps so far
    num_blocks: int
    block_size: int
    blocks: str  # one code per block of the device pool, by block id
    tenants: tuple[TenantBlocks, ...]
    num_free: int  # free and holding nothing cached
    num_evictable: int  # cached, unreferenced: matchable until reused
    num_used: int  # ref count > 0
    num_shared: int  # ref count > 1: copy-on-write, forks, beams, prefix hits of running requests
    prefix_cache: str | None  # "radix", "hash" or None (off)
    cached_blocks: int  # held by the prefix cache, in use or evictable
    evictions: int  # blocks, cumulative
    prefix_queries: int  # tokens looked up at admission, cumulative
    prefix_hits: int
    external_queries: int  # in the tiers, after the device hit
    external_hits: int
    num_running: int
    num_waiting: int
    num_loading: int  # waiting for blocks from a tier
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    tiers: tuple[TierSnapshot, ...]


def tenant_digest(extra_key: bytes) -> str:
    """What the dashboard may show of a partition of the cache: no salt, no name, no key."""
    if not extra_key:
        return "none"
    return hashlib.sha256(b"kvserve-dashboard\0" + extra_key).hexdigest()[:8]


def block_codes(kv: KVCacheManager, seq_letters: dict[int, int]) -> bytes:
    """One code per pool block: free, evictable, or the letter of a request holding it (upper case when
    a second table holds it too: ref count > 1, as the tables account for every reference).

    The one place that reads the pool and the tables (every KV group's): a change in how groups
    keep them changes only this. Runs in O(blocks) at C speed but for one pass over the pool and
    one over the tables (~10 ms for 100k blocks)."""
    codes = bytearray(FREE.encode() * kv.pool.num_blocks)
    for block in kv.pool.blocks:
        if block.cached and block.ref_cnt == 0:
            codes[block.block_id] = _EVICTABLE
    other = ord(TENANT_LETTERS[-1])
    for tables in (kv.block_tables, *kv.group_tables):
        for seq_id, table in tables.items():
            letter = seq_letters.get(seq_id, other)
            for block in table:
                if block is None:
                    continue
                code = codes[block.block_id]
                if code == _FREE:
                    codes[block.block_id] = letter
                elif code >= _LOWER_A:  # held by an earlier table too
                    codes[block.block_id] = code - 32
    return bytes(codes)


def _tenant_letters(engine: LLMEngine) -> tuple[dict[int, int], list[str]]:
    """Each request's letter (ord), and the digest of each letter in order; past the last letter,
    every further tenant shares it ("other")."""
    scheduler = engine.scheduler
    letter_of: dict[str, int] = {}
    seq_letters: dict[int, int] = {}
    for request in (*scheduler.running, *scheduler.loading):
        digest = tenant_digest(request.extra_key)
        if digest not in letter_of:
            letter_of[digest] = ord(TENANT_LETTERS[min(len(letter_of), len(TENANT_LETTERS) - 1)])
        seq_letters[request.seq_id] = letter_of[digest]
    digests = list(letter_of)[: len(TENANT_LETTERS)]
    if len(letter_of) > len(TENANT_LETTERS):
        digests[-1] = "other"
    return seq_letters, digests


def _tenant_blocks(codes: bytes, digests: list[str]) -> tuple[TenantBlocks, ...]:
    """The tenants holding blocks (a request still waiting holds none)."""
    letters = TENANT_LETTERS[: len(digests)]
    held = [(c, d, codes.count(ord(c)) + codes.count(ord(c.upper()))) for c, d in zip(letters, digests, strict=True)]
    return tuple(TenantBlocks(c, d, n) for c, d, n in held if n)


def capture_kv_state(engine: LLMEngine, num_waiting: int) -> KVState:
    """The engine's state now; call it on the engine thread only."""
    kv, stats, scheduler = engine.kv, engine.stats, engine.scheduler
    seq_letters, digests = _tenant_letters(engine)
    codes = block_codes(kv, seq_letters)
    num_free, num_evictable = codes.count(_FREE), codes.count(_EVICTABLE)
    shared = sum(codes.count(ord(c)) for c in TENANT_LETTERS.upper())
    cache = kv.prefix_cache
    p = kv.prefix_stats
    return KVState(
        taken=time.time(),
        step=stats.num_steps,
        num_blocks=kv.pool.num_blocks,
        block_size=kv.block_size,
        blocks=codes.decode(),
        tenants=_tenant_blocks(codes, digests),
        num_free=num_free,
        num_evictable=num_evictable,
        num_used=len(codes) - num_free - num_evictable,
        num_shared=shared,
        prefix_cache=engine.config.prefix_cache if cache is not None else None,
        cached_blocks=cache.size_info().cached_blocks if cache is not None else 0,
        evictions=stats.prefix_cache_evictions,  # as of the last step, as /metrics reports it
        prefix_queries=p.queries,
        prefix_hits=p.hits,
        external_queries=p.external_queries,
        external_hits=p.external_hits,
        num_running=len(scheduler.running),
        num_waiting=num_waiting,
        num_loading=len(scheduler.loading),
        num_preemptions=stats.num_preemptions,
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        tiers=tuple(engine.store.snapshot()) if engine.store is not None else (),
    )


class KVStateFeed:
    """The latest `KVState`: taken on the engine thread, read from any thread."""

    def __init__(self, engine: LLMEngine, num_waiting: Callable[[], int]):
        self.engine = engine
        self.num_waiting = num_waiting
        self.latest: KVState | None = None
        self._signature: tuple[int, ...] = ()  # of `latest`
        self._taken = 0.0  # monotonic, of `latest`
        self._interval = CAPTURE_INTERVAL
        self._watched_until = 0.0

    def capture(self) -> KVState:
        """Engine thread only."""
        signature, started = self.signature(), time.monotonic()
        state = capture_kv_state(self.engine, self.num_waiting())
        self._taken = time.monotonic()
        self._interval = max(CAPTURE_INTERVAL, (self._taken - started) / CAPTURE_SHARE)
        self.latest, self._signature = state, signature
        return state

    def after_step(self, outputs: object) -> None:
        """An `on_step` hook: a new snapshot now and then while someone watches."""
        now = time.monotonic()
        if now < self._watched_until and now - self._taken >= self._interval:
            self.capture()

    def signature(self) -> tuple[int, ...]:
        """Cheap counters that change whenever what a snapshot shows does (readable from any thread:
        a torn read only makes a reader ask for a new snapshot)."""
        engine = self.engine
        pool = engine.kv.pool
        finished = sum(engine.stats.finished_requests.values())
        running = len(engine.scheduler.running)
        return (engine.stats.num_steps, pool.num_free_blocks, pool.num_evictable_blocks, running, finished)

    def current(self) -> KVState | None:
        """The latest snapshot if it still holds (nothing changed since, or it is recent); None when
        the engine thread must take a new one. Marks the state as watched."""
        now = time.monotonic()
        self._watched_until = now + WATCH_FOR
        latest = self.latest
        if latest is None:
            return None
        if now - self._taken < 2 * self._interval or self.signature() == self._signature:
            return latest
        return None
