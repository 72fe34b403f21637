"""A randomized stateful test of KVCacheManager with each prefix cache, against a model of the K/V store.

Every slot written records the exact prefix (extra key and tokens up to and
including its own) whose K/V it holds; a cached block that was evicted and
reused, then matched without being recomputed, reads back the wrong prefix.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.engine.request import Request
from kvserve.kv_cache.block_pool import KVCacheBlock
from kvserve.kv_cache.hash_chain_cache import HashChainCache
from kvserve.kv_cache.kv_cache_manager import KVCacheManager, cdiv, make_prefix_cache
from kvserve.kv_cache.prefix_cache import CacheSize, PrefixCache, PrefixMatch, extra_key
from kvserve.kv_cache.radix_cache import RadixCache
from kvserve.sampling_params import SamplingParams

PREFIXES = [(1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6, 0, 0), (7, 7, 7, 7, 7, 7), ()]
SALTS = [b"", extra_key("tenant-a"), extra_key("tenant-b")]
TOKENS = st.integers(0, 2)  # a tiny vocabulary, so that siblings often write identical blocks

Slot = tuple[bytes, tuple[int, ...]]  # the prefix whose K/V a slot holds


@dataclass
class Preempted:
    request: Request
    blocks: list[KVCacheBlock]  # its cached (full) blocks when it was preempted
    evictions: int  # the cache's eviction count then


def slot(req: Request, pos: int) -> Slot:
    return req.extra_key, tuple(req.all_token_ids[: pos + 1])


def eviction_queue(cache: PrefixCache) -> list[list[int]]:
    if isinstance(cache, HashChainCache):
        return [[b.block_id] for b in cache.evictable]
    assert isinstance(cache, RadixCache)
    return [[b.block_id for b in leaf.blocks] for leaf in cache.evictable_leaves]


class PrefixCacheMachine(RuleBasedStateMachine):
    kind: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()
        self.running: list[Request] = []
        self.waiting: list[Preempted] = []
        # Forked children whose blocks are not inserted yet: the scheduler inserts them at their next step.
        self.not_inserted: set[int] = set()

    @initialize(num_blocks=st.integers(8, 24), block_size=st.integers(2, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        cache = make_prefix_cache(self.kind, block_size)
        assert cache is not None
        self.cache = cache
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, cache)
        self.store: dict[int, list[Slot | None]] = {i: [None] * block_size for i in range(num_blocks)}

    # helpers

    def _snapshot(self) -> tuple:
        kv = self.kv
        return (
            [(b.ref_cnt, b.cached) for b in kv.pool.blocks],
            [b.block_id for b in kv.pool.free_queue],
            {sid: [b.block_id for b in t] for sid, t in kv.block_tables.items()},
            {sid: (p.handle, p.num_blocks) for sid, p in kv.cached_prefixes.items()},
            self.cache.size_info(),
            self.cache.num_evictable_blocks,
            eviction_queue(self.cache),
            kv.pool.num_allocations,
        )

    def _check_holds(self, req: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """The first num_tokens slots of these blocks hold exactly this request's prefixes."""
        for pos in range(num_tokens):
            got = self.store[blocks[pos // self.bs].block_id][pos % self.bs]
            assert got == slot(req, pos), f"{req.request_id} position {pos} holds another prefix's K/V"

    def _allocate(self, req: Request, n: int, hit: PrefixMatch | None = None) -> bool:
        """allocate_slots; a refusal must be exact and change nothing."""
        available = self.kv.pool.num_available_blocks
        needed = self.kv.blocks_needed(req, n, hit)
        before = self._snapshot()
        ok = self.kv.allocate_slots(req, n, hit)
        assert ok == (needed <= available)
        if not ok:
            assert self._snapshot() == before
        return ok

    def _compute(self, req: Request, n: int, next_token: int) -> None:
        """One step's forward for n tokens, then what update_from_output does."""
        self._write(req, n)
        self._update(req, n, next_token)

    def _write(self, req: Request, n: int) -> None:
        """The forward's K/V writes for n tokens (copy-on-write copies first)."""
        for copy in self.kv.take_pending_copies():
            self.store[copy.dst] = list(self.store[copy.src])
        table = self.kv.block_tables[req.seq_id]
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.store[table[pos // self.bs].block_id][pos % self.bs] = slot(req, pos)

    def _update(self, req: Request, n: int, next_token: int) -> None:
        req.num_computed_tokens += n
        self.kv.cache_full_blocks(req)
        self.not_inserted.discard(req.seq_id)
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(next_token, None)

    def _admit(self, req: Request, chunk: int, next_token: int) -> list[KVCacheBlock] | None:
        """The scheduler's admission; returns the hit's blocks, or None when out of blocks."""
        size = self.cache.size_info()
        hit = self.kv.match_prefix(req)
        assert hit is not None and self.cache.size_info() == size
        cached = hit.num_blocks * self.bs
        assert cached < req.num_tokens  # the last token is always recomputed
        self._check_holds(req, hit.blocks, cached)
        n = min(chunk, req.num_tokens - cached)
        if not self._allocate(req, n, hit):
            assert req.seq_id not in self.kv.block_tables
            return None
        req.num_computed_tokens = cached
        self._compute(req, n, next_token)
        self.running.append(req)
        return hit.blocks

    def _pick(self, data: st.DataObject) -> Request:
        return self.running[data.draw(st.integers(0, len(self.running) - 1))]

    def _new_request(self, tokens: list[int], salt: bytes) -> Request:
        return Request(f"r{next(self.ids)}", tokens or [0], SamplingParams(), extra_key=salt)

    # rules

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(TOKENS, max_size=5),
        salt=st.sampled_from(SALTS),
        chunk=st.integers(1, 20),
        next_token=TOKENS,
    )
    def admit(self, prefix: tuple[int, ...], suffix: list[int], salt: bytes, chunk: int, next_token: int) -> None:
        self._admit(self._new_request(list(prefix) + suffix, salt), chunk, next_token)

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(TOKENS, max_size=5),
        salt=st.sampled_from(SALTS),
        tokens=st.tuples(TOKENS, TOKENS),
    )
    def admit_n2(self, prefix: tuple[int, ...], suffix: list[int], salt: bytes, tokens: tuple[int, int]) -> None:
        """Two samples, as the scheduler runs them: the fork comes before the prompt's blocks are inserted."""
        req = self._new_request(list(prefix) + suffix, salt)
        hit = self.kv.match_prefix(req)
        assert hit is not None
        cached = hit.num_blocks * self.bs
        if not self._allocate(req, req.num_tokens - cached, hit):
            return
        req.num_computed_tokens = cached
        child = self._new_request(list(req.all_token_ids), salt)
        self.kv.fork(req, child)
        self._compute(req, req.num_tokens - cached, tokens[0])
        child.num_computed_tokens = req.num_computed_tokens
        child.append_output_token(tokens[1], None)
        self.not_inserted.add(child.seq_id)
        self.running += [req, child]

    @rule(
        prefix=st.lists(st.integers(3, 9), min_size=2, max_size=12),  # mostly not cached yet
        suffixes=st.tuples(st.lists(TOKENS, max_size=5), st.lists(TOKENS, max_size=5)),
        salt=st.sampled_from(SALTS),
        same_salt=st.booleans(),
        chunks=st.tuples(st.integers(1, 20), st.integers(1, 20)),
        next_token=TOKENS,
    )
    def admit_together(self, prefix, suffixes, salt, same_salt, chunks, next_token) -> None:
        """Two requests admitted in one step: the second may match blocks the first is filling
        (in flight, same salt only); after the step's forward both tables hold their own prefixes."""
        salts = (salt, salt if same_salt else extra_key("tenant-c"))
        admitted = []
        for suffix, key, chunk in zip(suffixes, salts, chunks, strict=True):
            req = self._new_request(prefix + suffix, key)
            hit = self.kv.match_prefix(req)
            assert hit is not None
            cached = hit.num_blocks * self.bs
            assert cached < req.num_tokens
            assert all(b.ref_cnt > 0 for b in hit.in_flight)
            n = min(chunk, req.num_tokens - cached)
            if self._allocate(req, n, hit):
                req.num_computed_tokens = cached
                admitted.append((req, n))
        for req, n in admitted:  # the step's forward writes every new K/V before any attention reads
            self._write(req, n)
        for req, n in admitted:  # what each one's attention reads: its whole context
            self._check_holds(req, self.kv.block_tables[req.seq_id], req.num_computed_tokens + n)
        for req, n in admitted:  # then update_from_output, in admission order
            self._update(req, n, next_token)
            self.running.append(req)
        assert not self.kv.in_flight
        self.kv.check_integrity()

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 20), next_token=TOKENS)
    def readmit(self, data: st.DataObject, chunk: int, next_token: int) -> None:
        entry = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        hit = self._admit(entry.request, chunk, next_token)
        if hit is None:
            return
        self.waiting.remove(entry)
        if self.cache.num_evictions == entry.evictions:  # nothing evicted: its own blocks are all still there
            usable = (entry.request.num_tokens - 1) // self.bs
            expected = entry.blocks[:usable]
            assert hit[: len(expected)] == expected

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.sampled_from([1, 1, 1, 2, 5]), next_token=TOKENS)
    def step(self, data: st.DataObject, n: int, next_token: int) -> None:
        req = self._pick(data)
        n = min(n, req.num_tokens - req.num_computed_tokens)
        if self._allocate(req, n):
            self._compute(req, n, next_token)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self._pick(data)
        child = self._new_request(list(parent.all_token_ids), parent.extra_key)
        child.num_computed_tokens = parent.num_computed_tokens
        allocations = self.kv.pool.num_allocations
        self.kv.fork(parent, child)
        assert self.kv.pool.num_allocations == allocations
        if parent.seq_id in self.not_inserted:
            self.not_inserted.add(child.seq_id)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self._pick(data)
        self.running.remove(req)
        self.kv.free(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = self._pick(data)
        full = req.num_computed_tokens // self.bs
        blocks = list(itertools.takewhile(lambda b: b.cached, self.kv.block_tables[req.seq_id][:full]))
        assert req.seq_id in self.not_inserted or len(blocks) == full  # every filled block was inserted
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(Preempted(req, blocks, self.cache.num_evictions))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        del self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(TOKENS, max_size=5), salt=st.sampled_from(SALTS))
    def probe(self, prefix: tuple[int, ...], suffix: list[int], salt: bytes) -> None:
        """Whatever the cache returns, for any prompt, holds that prompt's K/V."""
        req = self._new_request(list(prefix) + suffix, salt)
        match = self.cache.match_prefix(req.all_token_ids, salt)
        self._check_holds(req, match.blocks, match.num_blocks * self.bs)

    @rule()
    def reset(self) -> None:
        size = self.cache.size_info()
        if self.running:
            assert not self.kv.reset_prefix_cache()
            assert self.cache.size_info() == size
            return
        assert self.kv.reset_prefix_cache()
        assert self.cache.size_info() == CacheSize(0, 0)
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks

    # invariants

    @invariant()
    def pool_and_cache_consistent(self) -> None:
        pool = self.kv.pool
        pool.check_integrity()
        self.cache.check_integrity()
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + self.cache.num_evictable_blocks + used == pool.num_blocks
        assert self.cache.size_info().evictable_blocks == self.cache.num_evictable_blocks
        assert sum(1 for b in pool.blocks if b.cached) == self.cache.size_info().cached_blocks
        assert self.kv.pending_copies == []

    @invariant()
    def ref_counts_are_holders(self) -> None:
        holders = Counter(b.block_id for t in self.kv.block_tables.values() for b in t)
        assert [b.ref_cnt for b in self.kv.pool.blocks] == [holders[i] for i in range(self.kv.pool.num_blocks)]

    @invariant()
    def tables_hold_exactly_their_tokens(self) -> None:
        assert set(self.kv.block_tables) == {r.seq_id for r in self.running}
        for req in self.running:
            table = self.kv.block_tables[req.seq_id]
            assert len(table) == cdiv(req.num_computed_tokens, self.bs)
            assert len({b.block_id for b in table}) == len(table)
            if req.seq_id not in self.not_inserted:
                assert all(b.cached for b in table[: req.num_computed_tokens // self.bs])
            self._check_holds(req, table, req.num_computed_tokens)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for req in self.running:
            self.kv.free(req)
        assert self.kv.reset_prefix_cache()
        assert self.cache.size_info() == CacheSize(0, 0)
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks
        self.kv.pool.check_integrity()
        self.cache.check_integrity()


class RadixMachine(PrefixCacheMachine):
    kind = "radix"


class HashMachine(PrefixCacheMachine):
    kind = "hash"


SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)
RadixMachine.TestCase.settings = SETTINGS
HashMachine.TestCase.settings = SETTINGS
TestRadixCacheStateful = RadixMachine.TestCase
TestHashChainCacheStateful = HashMachine.TestCase
