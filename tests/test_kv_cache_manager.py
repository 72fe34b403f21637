"""KVCacheManager: allocation, fork with copy-on-write, free; and a stateful property test."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.engine.request import Request
from kvserve.kv_cache.kv_cache_manager import BlockCopy, KVCacheManager, cdiv
from kvserve.sampling_params import SamplingParams


def make_request(request_id: str, num_tokens: int = 1) -> Request:
    return Request(request_id, list(range(num_tokens)), SamplingParams())


def snapshot(kv: KVCacheManager) -> tuple:
    """Everything a failed allocation must leave untouched."""
    return (
        [b.ref_cnt for b in kv.pool.blocks],
        {sid: [b.block_id for b in t] for sid, t in kv.block_tables.items()},
        [b.block_id for b in kv.pool.free_queue],
        kv.pool.num_allocations,
        list(kv.pending_copies),
        kv.num_cow_copies,
    )


def test_allocate_in_chunks_grows_table() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a", 10)
    assert kv.blocks_needed(req, 6) == 2
    assert kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    assert kv.blocks_needed(req, 2) == 0  # fits in the partly filled block
    assert kv.allocate_slots(req, 2)
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 2)
    assert kv.block_ids(req) == [0, 1, 2]
    assert kv.pool.num_allocations == 3


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate_slots(a, 12)
    before = snapshot(kv)
    assert not kv.allocate_slots(b, 8)
    assert snapshot(kv) == before
    assert b.seq_id not in kv.block_tables


def test_failed_copy_on_write_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = make_request("p")
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    kv.fork(parent, child)
    before = snapshot(kv)
    assert kv.blocks_needed(child, 1) == 1  # the copy of the shared partial block
    assert not kv.allocate_slots(child, 1)
    assert snapshot(kv) == before


def test_free_returns_blocks_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request("a")
    assert kv.allocate_slots(req, 12)
    kv.free(req)
    assert [b.block_id for b in kv.pool.free_queue] == [3, 2, 1, 0]
    assert kv.block_ids(req) == []
    kv.free(req)  # freeing a request without blocks is a no-op
    kv.pool.check_integrity()


def test_copy_on_write_200_token_prompt_8_samples() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=16)
    parent = make_request("p", 200)
    assert kv.allocate_slots(parent, 200)
    parent.num_computed_tokens = 200
    assert kv.pool.num_allocations == 13
    shared_tail = kv.block_ids(parent)[-1]

    children = [parent.fork(i) for i in range(1, 8)]
    for child in children:
        assert child.num_computed_tokens == 200
        kv.fork(parent, child)
    samples = [parent, *children]
    assert kv.pool.num_allocations == 13  # forks share, they allocate nothing
    assert all(b.ref_cnt == 8 for b in kv.block_tables[parent.seq_id])

    for req in samples:
        assert kv.allocate_slots(req, 1)
    copies = kv.take_pending_copies()
    assert len(copies) == 7 and kv.num_cow_copies == 7
    assert all(c.src == shared_tail for c in copies)
    assert len({c.dst for c in copies}) == 7
    # The last writer is the only owner left, so it writes in place.
    assert kv.block_ids(samples[-1])[-1] == shared_tail
    assert {c.dst for c in copies} == {kv.block_ids(r)[-1] for r in samples[:-1]}
    assert all(kv.block_ids(r)[:12] == kv.block_ids(parent)[:12] for r in samples)
    assert kv.pool.num_allocations == 20
    assert kv.take_pending_copies() == []

    for req in samples:
        kv.free(req)
    assert kv.pool.num_free_blocks == 64
    kv.pool.check_integrity()


def test_fork_at_block_boundary_needs_no_copy() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p")
    assert kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = parent.fork(1)
    kv.fork(parent, child)
    for req in (parent, child):
        assert kv.blocks_needed(req, 1) == 1
        assert kv.allocate_slots(req, 1)
    assert kv.take_pending_copies() == []
    assert kv.block_ids(parent)[:2] == kv.block_ids(child)[:2]
    assert kv.block_ids(parent)[2] != kv.block_ids(child)[2]


def test_copy_on_write_and_growth_in_one_allocation() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p")
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(1)
    kv.fork(parent, child)
    assert kv.blocks_needed(child, 7) == 3  # one copy + two new blocks
    assert kv.allocate_slots(child, 7)
    (copy,) = kv.take_pending_copies()
    assert copy == BlockCopy(src=1, dst=kv.block_ids(child)[1])
    assert len(kv.block_ids(child)) == 4
    assert kv.pool.num_used_blocks == 5


# Stateful property test: random allocate / append / fork / free / preempt / resume.

BLOCK_SIZE = 4


@dataclass
class Seq:
    request: Request
    tokens: list[int]  # the whole sequence this request will have written
    running: bool = True


class BlockAccounting(RuleBasedStateMachine):
    """Models a physical KV store so that copy-on-write bugs show up as wrong read-backs."""

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[str, Seq] = {}
        self.ids = itertools.count()
        self.token_values = itertools.count()  # every written token is unique

    @initialize(num_blocks=st.integers(8, 32))
    def setup(self, num_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE)
        self.store: dict[int, list[int | None]] = {i: [None] * BLOCK_SIZE for i in range(num_blocks)}

    # helpers

    def _new_tokens(self, n: int) -> list[int]:
        return [next(self.token_values) for _ in range(n)]

    def _ids(self, running: bool) -> list[str]:
        return sorted(rid for rid, s in self.seqs.items() if s.running == running)

    def _allocate(self, seq: Seq, n: int) -> bool:
        """allocate_slots, then (on success) run the step: copies, writes, advance."""
        req, kv = seq.request, self.kv
        needed = kv.blocks_needed(req, n)
        free_before, used_before = kv.pool.num_free_blocks, kv.pool.num_used_blocks
        before = snapshot(kv)
        ok = kv.allocate_slots(req, n)
        assert ok == (needed <= free_before)
        if not ok:
            assert snapshot(kv) == before
            return False
        assert kv.pool.num_used_blocks - used_before == needed
        for copy in kv.take_pending_copies():
            self.store[copy.dst] = list(self.store[copy.src])
        table = kv.block_ids(req)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.store[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = seq.tokens[pos]
        req.num_computed_tokens += n
        return True

    # rules

    @rule(n=st.integers(1, 40))
    def allocate(self, n: int) -> None:
        rid = f"r{next(self.ids)}"
        seq = Seq(make_request(rid, n), self._new_tokens(n))
        if self._allocate(seq, n):
            self.seqs[rid] = seq
        else:
            assert seq.request.seq_id not in self.kv.block_tables

    @precondition(lambda self: self._ids(running=True))
    @rule(data=st.data(), n=st.sampled_from([1, 1, 1, 2, 5]))
    def append(self, data: st.DataObject, n: int) -> None:
        seq = self.seqs[data.draw(st.sampled_from(self._ids(running=True)))]
        seq.tokens.extend(self._new_tokens(n))
        if not self._allocate(seq, n):
            del seq.tokens[-n:]

    @precondition(lambda self: self._ids(running=True))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.seqs[data.draw(st.sampled_from(self._ids(running=True)))]
        child = parent.request.fork(next(self.ids))
        assert child.num_computed_tokens == parent.request.num_computed_tokens
        allocations = self.kv.pool.num_allocations
        self.kv.fork(parent.request, child)
        assert self.kv.pool.num_allocations == allocations
        self.seqs[child.request_id] = Seq(child, list(parent.tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.seqs)))
        blocks = list(self.kv.block_tables.get(self.seqs[rid].request.seq_id, []))
        self.kv.free(self.seqs.pop(rid).request)
        for block in blocks:
            if block.ref_cnt == 0:
                with pytest.raises(RuntimeError):
                    self.kv.pool.free_blocks([block])

    @precondition(lambda self: self._ids(running=True))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = self.seqs[data.draw(st.sampled_from(self._ids(running=True)))]
        self.kv.free(seq.request)
        seq.request.num_computed_tokens = 0
        seq.running = False

    @precondition(lambda self: self._ids(running=False))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        seq = self.seqs[data.draw(st.sampled_from(self._ids(running=False)))]
        seq.running = self._allocate(seq, len(seq.tokens))

    # invariants

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        pool.check_integrity()
        assert self.kv.pending_copies == []

    @invariant()
    def ref_counts_match_tables(self) -> None:
        holders = Counter(b.block_id for t in self.kv.block_tables.values() for b in t)
        assert [b.ref_cnt for b in self.kv.pool.blocks] == [holders[i] for i in range(self.kv.pool.num_blocks)]

    @invariant()
    def tables_match_requests(self) -> None:
        seq_ids = [self.seqs[rid].request.seq_id for rid in self._ids(running=True)]
        assert len(set(seq_ids)) == len(seq_ids)
        assert set(self.kv.block_tables) == set(seq_ids)
        for rid in self._ids(running=True):
            req = self.seqs[rid].request
            table = self.kv.block_ids(req)
            assert len(table) == cdiv(req.num_computed_tokens, BLOCK_SIZE)
            assert len(set(table)) == len(table)

    @invariant()
    def every_request_reads_back_its_own_tokens(self) -> None:
        for rid in self._ids(running=True):
            seq = self.seqs[rid]
            table = self.kv.block_ids(seq.request)
            n = seq.request.num_computed_tokens
            read = [self.store[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] for p in range(n)]
            assert read == seq.tokens[:n], f"{rid} reads another request's K/V"

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for seq in self.seqs.values():
            self.kv.free(seq.request)
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        self.kv.pool.check_integrity()


BlockAccounting.TestCase.settings = settings(max_examples=75, stateful_step_count=30, deadline=None)
TestBlockAccounting = BlockAccounting.TestCase


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_lease_being_read_neither_expires_nor_frees_until_the_read_ends(kind: str) -> None:
    """A decode replica's pull reads leased blocks on its own thread: released or past its deadline
    meanwhile, the lease keeps its blocks until the read ends, then the next expiry frees them."""
    from kvserve.kv_cache.kv_cache_manager import make_prefix_cache

    kv = KVCacheManager(num_blocks=8, block_size=4, prefix_cache=make_prefix_cache(kind, 4))
    request = make_request("r", 13)
    assert kv.allocate_slots(request, 13)
    request.num_computed_tokens = 13
    kv.cache_full_blocks(request)
    held = kv.hold("r", request, seconds=30)
    kv.free(request)
    assert len(held) == 3 and kv.pool.num_used_blocks == 3
    ids = kv.begin_read("r", request.block_keys[:2] + [b"another tenant's key"], seconds=30)
    assert ids == held[:2]  # only the leading run of its own keys
    assert kv.begin_read("r", [b"x"], seconds=30) == []  # no run: no read begun
    assert kv.release("r") and kv.expire_leases(now=float("inf")) == 0
    assert kv.pool.num_used_blocks == 3 and kv.begin_read("r", request.block_keys, seconds=30) == []
    kv.check_integrity()
    kv.end_read("r")
    assert kv.expire_leases(now=0.0) == 1 and kv.num_expired_leases == 0  # released, not expired
    assert kv.pool.num_used_blocks == 0 and not kv.leases
    kv.check_integrity()
