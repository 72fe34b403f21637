"""A randomized stateful test of KVCacheManager over real KV tiers (host RAM, then disk), no torch.

The test plays the engine: it keeps a model of the device pool (each slot records the
exact prefix, extra key and tokens up to and including its own, whose K/V it holds),
reads blocks out for `pending_saves` as `KVTransfer.save` does (asking `store.wanted`),
and writes `pending_loads` back into the model. A payload is one 16-byte digest per slot
of the prefix that slot holds, so a block loaded under a wrong key, at a wrong position
or for another tenant reads back the wrong prefix. Admission is the scheduler's own
sequence: `match_prefix`, `start_load`, then (at once, or after the load arrived or
timed out, other steps having run meanwhile) `loaded_blocks`, `allocate_slots` and
`queue_loads`. The store's loader thread really runs the loads, but only when the test
lets it (`LoadGate`), so that every run of an example does the same.

After every operation: the pool's free + evictable + used blocks are all of them, every
tier holds no more than its capacity (and exactly as many blocks as its LRU must), each
save the manager queued is exactly the blocks that left the pool (write-back) or filled
(write-through) under their content's keys, and each load brought exactly the leading
blocks the tiers still held. Two paths the machine reaches only now and then (a device hit
that grew, or was evicted, while its load ran) are also driven step by step at the end.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import shutil
import tempfile
import threading
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.kv_cache.block_keys import chain_keys
from kvserve.kv_cache.kv_cache_manager import KVCacheManager, cdiv, make_prefix_cache
from kvserve.kv_cache.prefix_cache import extra_key
from kvserve.kv_cache.tiers import record
from kvserve.kv_cache.tiers.base import KVTier
from kvserve.kv_cache.tiers.disk import SUFFIX, DiskTier
from kvserve.kv_cache.tiers.host import HostTier
from kvserve.kv_cache.tiers.namespace import Namespace, tier_key
from kvserve.kv_cache.tiers.store import TieredKVStore, WritePolicy

# Prompts share prefixes across tenants on purpose: a tier must never serve one tenant's block to another.
PREFIXES = [(1, 2, 3, 4, 5, 6, 7, 8, 9), (1, 2, 3, 4, 5, 6, 0, 0), (7, 7, 7, 7, 7, 7), (1, 2, 3), ()]
SALTS = [b"", extra_key("tenant-a"), extra_key("tenant-b")]
TOKENS = st.integers(0, 2)
SUFFIXES = st.lists(TOKENS, max_size=3)
SLOT_BYTES = 16  # one slot's digest; the namespace's block is (1, 2, block_size, 1, 2) float32 = 16 bytes a slot
MAX_RUNNING = 3  # admission rules stop there, so that blocks stay available for loads

Slot = tuple[bytes, tuple[int, ...]]  # the prefix whose K/V a slot holds


@dataclass(eq=False)
class Req:
    """A KVRequest stand-in."""

    seq_id: int
    tokens: list[int]
    extra_key: bytes
    num_computed_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class Plan:
    """A request's lookup in the tiers: from block `first` on, the tier start_load found each
    block in; once it is over (arrived or timed out), how many blocks it brought."""

    first: int
    tiers: list[KVTier]
    future: Future | None
    arrived: int | None


class LoadGate:
    """Holds the store's loader thread: a load runs only once the test lets it go, and the
    test waits for it, so no read races a rule's writes. The loader runs loads in order,
    one at a time: the one running is the first not done, and may read once released."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()  # the test's thread: its reads (host-only loads) pass
        self.cond = threading.Condition()
        self.futures: list[Future] = []  # the store's loads, in the order it submitted them
        self.released = 0  # the first `released` of them may run
        self.open = False  # at teardown: all may

    def add(self, future: Future) -> None:
        with self.cond:
            self.futures.append(future)

    def run_through(self, future: Future) -> None:
        """Let this load and every one before it run, and wait for them."""
        with self.cond:
            self.released = max(self.released, self.futures.index(future) + 1)
            self.cond.notify_all()
        future.result(timeout=30)

    def open_all(self) -> None:
        with self.cond:
            self.open = True
            self.cond.notify_all()

    def pass_through(self) -> None:
        if threading.get_ident() == self.owner:
            return
        with self.cond:
            assert self.cond.wait_for(self._may_run, timeout=30), "a load was never let go"

    def _may_run(self) -> bool:
        if self.open:
            return True
        running = next((i for i, f in enumerate(self.futures) if not f.done()), None)
        return running is not None and running < self.released


class GatedHostTier(HostTier):
    def __init__(self, capacity_bytes: int, slot_bytes: int, gate: LoadGate) -> None:
        super().__init__(capacity_bytes, slot_bytes)  # in an arena, as the engine's
        self.gate = gate

    def get(self, keys):
        self.gate.pass_through()
        return super().get(keys)


class GatedDiskTier(DiskTier):
    def __init__(self, directory: Path, capacity_bytes: int, namespace: Namespace, gate: LoadGate) -> None:
        super().__init__(directory, capacity_bytes, namespace)
        self.gate = gate

    def get(self, keys):
        self.gate.pass_through()
        return super().get(keys)


def note(what: str) -> None:
    """A hypothesis event (see --hypothesis-show-statistics), also when a plain test drives the machine."""
    if currently_in_test_context():
        event(what)


def slot(req: Req, pos: int) -> Slot:
    return req.extra_key, tuple(req.tokens[: pos + 1])


class TierMachine(RuleBasedStateMachine):
    kind: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()
        self.running: list[Req] = []
        self.waiting: list[Req] = []  # not admitted (out of blocks), preempted, or back from loading
        self.loading: list[Req] = []  # waiting for their load from disk
        self.plans: dict[int, Plan] = {}  # by seq_id, while the manager holds the request's load
        self.digests: dict[bytes, Slot | None] = {bytes(SLOT_BYTES): None}
        self.keys: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self.num_loaded: Counter[bytes] = Counter()  # blocks the test wrote from the tiers, by extra key
        self.num_saved = 0  # blocks handed to store.save
        self.num_timeouts = 0

    @initialize(
        num_blocks=st.integers(8, 12),
        block_size=st.integers(2, 3),
        host_blocks=st.integers(1, 4),
        disk_blocks=st.integers(0, 5),
        slack=st.integers(0, 15),
        policy=st.sampled_from(list(WritePolicy)),
    )
    def setup(self, num_blocks, block_size, host_blocks, disk_blocks, slack, policy) -> None:
        self.bs = block_size
        self.ns = Namespace("stateful", "float32", block_size, (1, 2, block_size, 1, 2))
        assert self.ns.block_nbytes == SLOT_BYTES * block_size
        self.file_size = record.header_size(self.ns) + self.ns.block_nbytes
        self.host_blocks, self.disk_blocks = host_blocks, disk_blocks
        self.gate = LoadGate()
        self.dir = Path(tempfile.mkdtemp(prefix="kvserve-tiers-"))
        self.host = GatedHostTier(host_blocks * self.ns.block_nbytes + slack, self.ns.block_nbytes, self.gate)
        self.disk = GatedDiskTier(self.dir, disk_blocks * self.file_size + slack, self.ns, self.gate)
        self.store = TieredKVStore(self.ns, [self.host, self.disk], policy, load_timeout=3600.0)
        cache = make_prefix_cache(self.kind, block_size)
        assert cache is not None
        self.cache = cache
        self.kv = KVCacheManager(num_blocks, block_size, cache, self.store)
        self.blocks: dict[int, list[Slot | None]] = {i: [None] * block_size for i in range(num_blocks)}
        self.cached = self._cached_now()

    # the model's keys and payloads

    def _key(self, key: bytes, tokens: tuple[int, ...]) -> bytes:
        """The chained block key of the block ending `tokens` (a whole number of blocks)."""
        if (key, tokens) not in self.keys:
            self.keys[key, tokens] = chain_keys(b"", tokens, self.bs, key)[-1]
        return self.keys[key, tokens]

    def _content_key(self, block_id: int) -> bytes:
        """The key of the prefix a full block holds, read from what it holds."""
        last = self.blocks[block_id][-1]
        assert last is not None and len(last[1]) % self.bs == 0, f"block {block_id} is not full"
        return self._key(*last)

    def _tier_key(self, req: Req, i: int) -> bytes:
        return tier_key(self.ns.digest, self._key(req.extra_key, tuple(req.tokens[: (i + 1) * self.bs])))

    def _encode(self, block_id: int) -> bytes:
        out = []
        for s in self.blocks[block_id]:
            d = hashlib.blake2b(repr(s).encode(), digest_size=SLOT_BYTES).digest() if s else bytes(SLOT_BYTES)
            self.digests[d] = s
            out.append(d)
        payload = b"".join(out)
        assert len(payload) == self.ns.block_nbytes
        return payload

    def _decode(self, payload) -> list[Slot | None]:
        raw = bytes(payload)
        assert len(raw) == self.ns.block_nbytes
        return [self.digests[raw[i : i + SLOT_BYTES]] for i in range(0, len(raw), SLOT_BYTES)]

    def _cached_now(self) -> dict[int, bytes]:
        return {b.block_id: self._content_key(b.block_id) for b in self.kv.pool.blocks if b.cached}

    def _holding(self, req: Req, first: int) -> list[KVTier]:
        """Where the tiers hold the request's blocks from `first` on, one after another: what
        start_load plans to read. In runs: the first tier (host RAM first) holding the next block
        serves every block it holds in a row from there, even those host RAM holds too."""
        keys = [self._tier_key(req, i) for i in range(first, (req.num_tokens - 1) // self.bs)]
        out: list[KVTier] = []
        while len(out) < len(keys):
            run = next(((t, n) for t in (self.host, self.disk) if (n := t.contains(keys[len(out) :]))), None)
            if run is None:
                break
            out += [run[0]] * run[1]
        return out

    # the engine's side: saves (KVTransfer.save), copies, loads, the forward

    def _drain_saves(self, filled: bool) -> None:
        """Check the queued saves against the blocks that left the pool (or were cached) since the
        last drain, then save what the store wants, as KVTransfer.save does, and wait for the writes."""
        now = self._cached_now()
        if filled:
            changed = {(now[i], i) for i in now.keys() - self.cached.keys()}
            expected = changed if self.store.saves_on_fill else set()
        else:
            changed = {(self.cached[i], i) for i in self.cached.keys() - now.keys()}
            expected = changed if self.store.saves_on_evict else set()
        saves = self.kv.take_pending_saves()
        assert all(s.filled == filled for s in saves), "a save of the other kind"
        got = [(s.block_key, s.block_id) for s in saves]
        assert len(got) == len(set(got)) and set(got) == expected, (
            f"queued saves {got} are not the blocks that {'filled' if filled else 'left the pool'}: {expected}"
        )
        self.cached = now
        wanted = self.store.wanted([s.block_key for s in saves], filled)
        batch = [s for s, w in zip(saves, wanted, strict=True) if w]
        if not batch:
            return
        tkeys = self.store.keys([s.block_key for s in batch])
        assert len(set(tkeys)) == len(tkeys)
        host_before, disk_before = len(self.host), len(self.disk)
        if filled:  # write-through: to every local tier
            host_after = min(self.host_blocks, host_before + sum(not self.host.contains([k]) for k in tkeys))
            disk_after = min(self.disk_blocks, disk_before + sum(not self.disk.contains([k]) for k in tkeys))
        else:  # write-back: only blocks no local tier holds, to host RAM; what that pushes out, to disk
            assert not any(t.contains([k]) for t in (self.host, self.disk) for k in tkeys), (
                "wanted() asked for a block a tier holds"
            )
            host_after = min(self.host_blocks, host_before + len(batch))
            disk_after = min(self.disk_blocks, disk_before + host_before + len(batch) - host_after)
        self.store.save([s.block_key for s in batch], [self._encode(s.block_id) for s in batch], filled)
        self.store.flush()
        self.num_saved += len(batch)
        assert (len(self.host), len(self.disk)) == (host_after, disk_after), "a tier holds the wrong number"
        newest = tkeys[-min(len(tkeys), self.host_blocks) :]
        assert self.host.contains(newest) == len(newest), "host RAM lost a block it just stored"
        if filled and len(tkeys) <= self.disk_blocks:
            assert self.disk.contains(tkeys) == len(tkeys), "disk lost a block it just stored"

    def _schedule(self, batch: list[tuple[Req, int]]) -> list[Req]:
        """The scheduler's admission of waiting requests in one step, then the step itself; returns
        the admitted ones. Stops at the first that does not fit, as `_schedule_waiting` does."""
        admitted: list[tuple[Req, int, int, int]] = []  # request, new tokens, first loaded block, loaded
        for req, chunk in batch:
            hit = self.kv.match_prefix(req)
            assert hit is not None
            if req.seq_id not in self.kv.loads:  # its lookup in the tiers
                tiers = self._holding(req, hit.num_blocks)
                waits = self.kv.start_load(req, hit)
                load = self.kv.loads.get(req.seq_id)
                assert (load is not None) == bool(tiers), f"the tiers hold {len(tiers)} blocks, the load differs"
                if load is not None:
                    assert waits == (load.future is not None) == (self.disk in tiers)
                    self.plans[req.seq_id] = Plan(hit.num_blocks, tiers, load.future, None if waits else len(tiers))
                if waits:
                    note("a load waits for disk")
                    self.gate.add(load.future)
                    self._unqueue(req)
                    self.loading.append(req)
                    continue
            else:
                assert not self.kv.start_load(req, hit)  # once per admission
            hit, loaded = self.kv.loaded_blocks(req, hit)
            plan = self.plans.get(req.seq_id)
            expected = 0
            if plan is not None:
                assert plan.arrived is not None
                skip = hit.num_blocks - plan.first
                expected = max(0, plan.arrived - skip) if skip >= 0 else 0
                if skip and plan.arrived:
                    note(f"the device hit {'grew' if skip > 0 else 'shrank'} while its load ran")
            assert len(loaded) == expected, f"loaded {len(loaded)} blocks, the tiers held {expected} of them"
            cached = hit.num_blocks * self.bs
            computed = cached + len(loaded) * self.bs
            n = min(req.num_tokens - computed, chunk)
            assert n >= 1  # the last token is always computed
            needed = self.kv.blocks_needed(req, computed - cached + n, hit)
            available, before = self.kv.pool.num_available_blocks, len(self.kv.pending_saves)
            if not self.kv.allocate_slots(req, computed - cached + n, hit):
                assert needed > available and len(self.kv.pending_saves) == before
                assert req.seq_id not in self.kv.block_tables
                if req not in self.waiting:
                    self._unqueue(req)
                    self.waiting.append(req)
                break
            assert needed <= available
            self.kv.queue_loads(req, hit.num_blocks, loaded)
            assert req.seq_id not in self.kv.loads
            self.plans.pop(req.seq_id, None)
            req.num_computed_tokens = computed
            admitted.append((req, n, hit.num_blocks, len(loaded)))
            self._unqueue(req)
            self.running.append(req)
        self._step([(r, n) for r, n, _, _ in admitted], {r.seq_id: (f, k) for r, _, f, k in admitted})
        return [r for r, _, _, _ in admitted]

    def _unqueue(self, req: Req) -> None:
        for queue in (self.waiting, self.loading):
            if req in queue:
                queue.remove(req)

    def _step(self, batch: list[tuple[Req, int]], loads: dict[int, tuple[int, int]] | None = None) -> None:
        """One forward over `batch` (requests and their new tokens), after the blocks have moved:
        evicted ones read out first, then copy-on-write copies, then loads."""
        self._drain_saves(filled=False)
        for copy in self.kv.take_pending_copies():
            self.blocks[copy.dst] = list(self.blocks[copy.src])
        owner = {}
        for req, _ in batch:
            first, count = (loads or {}).get(req.seq_id, (0, 0))
            for i in range(first, first + count):
                owner[self.kv.block_tables[req.seq_id][i].block_id] = (req, i)
        for load in self.kv.take_pending_loads():
            assert load.block_id in owner, f"a load into block {load.block_id}, which no admitted request loads"
            req, i = owner.pop(load.block_id)
            got = self._decode(load.payload)
            want = [slot(req, pos) for pos in range(i * self.bs, (i + 1) * self.bs)]
            assert all(s is not None and s[0] == req.extra_key for s in got), "a block of another tenant was loaded"
            assert got == want, f"block {i} of a request was loaded with another prefix's K/V"
            self.blocks[load.block_id] = got
            self.num_loaded[req.extra_key] += 1
            note("a block came from a tier")
        assert not owner, "a loaded block was never written"
        for req, n in batch:
            table = self.kv.block_tables[req.seq_id]
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                self.blocks[table[pos // self.bs].block_id][pos % self.bs] = slot(req, pos)
        for req, n in batch:  # what each one's attention reads: its whole context
            self._check_holds(req, req.num_computed_tokens + n)
        for req, n in batch:
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.tokens.append((req.num_tokens + req.seq_id) % 3)
        assert not self.kv.in_flight
        self._drain_saves(filled=True)

    def _check_holds(self, req: Req, num_tokens: int) -> None:
        table = self.kv.block_tables[req.seq_id]
        for pos in range(num_tokens):
            got = self.blocks[table[pos // self.bs].block_id][pos % self.bs]
            assert got == slot(req, pos), f"request {req.seq_id} position {pos} holds another prefix's K/V"

    def _free(self, req: Req) -> None:
        self.kv.free(req)
        self.plans.pop(req.seq_id, None)
        self._drain_saves(filled=False)  # nothing: freeing evicts nothing

    def _new(self, prefix: tuple[int, ...], suffix: list[int], salt: bytes) -> Req:
        return Req(next(self.ids), list(prefix) + suffix or [0], salt)

    def _in_flight(self) -> list[Req]:
        return [r for r in self.loading if self.plans[r.seq_id].arrived is None]

    def _return_loaded(self) -> None:
        """The scheduler's: requests whose loads are over go back to the queue."""
        for req in list(self.loading):
            if self.plans[req.seq_id].arrived is not None:
                assert self.kv.load_ready(req)
                self.loading.remove(req)
                self.waiting.append(req)

    def _arrive(self, req: Req) -> None:
        """The loader thread reads this request's load (and those queued before it): each brings
        the leading blocks still in the tier start_load found them in (steps since may have moved them)."""
        target = self.plans[req.seq_id].future
        assert target is not None
        upto = self.gate.futures.index(target)
        arriving = [r for r in self._in_flight() if self.gate.futures.index(self.plans[r.seq_id].future) <= upto]
        for r in arriving:
            plan = self.plans[r.seq_id]
            still = [t.contains([self._tier_key(r, plan.first + i)]) for i, t in enumerate(plan.tiers)]
            plan.arrived = next((i for i, s in enumerate(still) if not s), len(still))
            if plan.arrived < len(plan.tiers):
                note("a load found fewer blocks than planned")
        self.gate.run_through(target)
        for r in arriving:
            load = self.kv.loads[r.seq_id]
            assert load.done and len(load.payloads()) == self.plans[r.seq_id].arrived
        self._return_loaded()

    def _time_out(self, req: Req) -> None:
        """Its deadline passes before the loader got to it: it computes everything after its device hit."""
        self.kv.loads[req.seq_id].deadline = -math.inf
        assert self.kv.load_ready(req)
        self.plans[req.seq_id].arrived = 0
        self.num_timeouts += 1
        note("a load timed out")
        self._return_loaded()

    # rules

    @precondition(lambda self: len(self.running) < MAX_RUNNING)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=SUFFIXES, salt=st.sampled_from(SALTS))
    def admit(self, prefix, suffix, salt) -> None:
        self._schedule([(self._new(prefix, suffix, salt), 1 << 10)])

    @rule(prefix=st.sampled_from(PREFIXES), suffix=SUFFIXES, salt=st.sampled_from(SALTS))
    def serve(self, prefix, suffix, salt) -> None:
        """A short request: its whole prompt in one step, then it finishes (its blocks stay cached)."""
        for req in self._schedule([(self._new(prefix, suffix, salt), 1 << 10)]):
            self.running.remove(req)
            self._free(req)

    @rule(prefix=st.sampled_from(PREFIXES), salt=st.sampled_from(SALTS))
    def serve_again(self, prefix, salt) -> None:
        """The same, for a prompt that may well be in a tier (so these are drawn more often)."""
        self.serve(prefix, [], salt)

    @precondition(lambda self: len(self.running) < MAX_RUNNING)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffixes=st.tuples(SUFFIXES, SUFFIXES),
        salts=st.tuples(st.sampled_from(SALTS), st.sampled_from(SALTS)),
        chunks=st.tuples(st.integers(1, 16), st.integers(1, 16)),
    )
    def admit_together(self, prefix, suffixes, salts, chunks) -> None:
        """Two in one step: the second may continue through blocks the first loads or computes."""
        reqs = [self._new(prefix, s, k) for s, k in zip(suffixes, salts, strict=True)]
        self._schedule(list(zip(reqs, chunks, strict=True)))

    @precondition(lambda self: self.running or self.waiting or self.loading)
    @rule(
        data=st.data(),
        blocks=st.integers(0, 3),
        extra=st.integers(0, 2),
        suffix=SUFFIXES,
        salt=st.none() | st.sampled_from(SALTS),
    )
    def admit_like(self, data: st.DataObject, blocks: int, extra: int, suffix: list[int], salt: bytes | None) -> None:
        """A prompt sharing a prefix with one already here (a loading one if any; of the same tenant,
        or not), up to some blocks after where that one's load starts: while the other waits for
        its load, this one may compute part of it, or evict what it continues."""
        known = self.loading or self.waiting + self.running
        other = known[data.draw(st.integers(0, len(known) - 1))]
        plan = self.plans.get(other.seq_id)
        cut = ((plan.first if plan else 0) + blocks) * self.bs + extra
        key = other.extra_key if salt is None else salt
        self._schedule([(self._new(tuple(other.tokens[:cut]), suffix, key), 1 << 10)])

    @precondition(lambda self: any(self.plans[r.seq_id].arrived is None for r in self.loading))
    @rule(data=st.data())
    def load_arrives(self, data: st.DataObject) -> None:
        in_flight = self._in_flight()
        self._arrive(in_flight[data.draw(st.integers(0, len(in_flight) - 1))])

    @precondition(lambda self: any(self.plans[r.seq_id].arrived is None for r in self.loading))
    @rule(data=st.data())
    def load_times_out(self, data: st.DataObject) -> None:
        in_flight = self._in_flight()
        self._time_out(in_flight[data.draw(st.integers(0, len(in_flight) - 1))])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def readmit(self, data: st.DataObject, chunk: int) -> None:
        """A request back from loading (or waiting for blocks) is admitted; the device pool may
        have gained or lost its prefix meanwhile."""
        req = self.waiting[data.draw(st.integers(0, len(self.waiting) - 1))]
        assert self.kv.load_ready(req)
        self._schedule([(req, chunk)])

    @precondition(lambda self: self.running)
    @rule(data=st.data(), n=st.sampled_from([1, 1, 2, 5]))
    def step(self, data: st.DataObject, n: int) -> None:
        req = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        n = min(n, req.num_tokens - req.num_computed_tokens)
        if self.kv.allocate_slots(req, n):
            self._step([(req, n)])
        else:
            assert not self.kv.pending_saves

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.running[data.draw(st.integers(0, len(self.running) - 1))]
        child = Req(next(self.ids), list(parent.tokens), parent.extra_key, parent.num_computed_tokens)
        child.block_keys = list(parent.block_keys)
        self.kv.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self._free(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self._free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: self.waiting or self.loading)
    @rule(data=st.data())
    def abort_waiting(self, data: st.DataObject) -> None:
        """Aborted while queued or loading (a load still under way is then ignored when it ends)."""
        queue = self.waiting + self.loading
        req = queue[data.draw(st.integers(0, len(queue) - 1))]
        self._unqueue(req)
        self._free(req)
        assert req.seq_id not in self.kv.loads

    @precondition(lambda self: not self.running)
    @rule()
    def reset(self) -> None:
        """Forgets the device pool's prefixes, not the tiers'."""
        tiers = (len(self.host), len(self.disk))
        assert self.kv.reset_prefix_cache()
        assert not self.kv.pending_saves and (len(self.host), len(self.disk)) == tiers
        self.cached = self._cached_now()
        assert not self.cached

    # invariants

    @invariant()
    def device_blocks_add_up(self) -> None:
        kv, pool = self.kv, self.kv.pool
        kv.check_integrity()
        used = sum(1 for b in pool.blocks if b.ref_cnt > 0)
        assert pool.num_free_blocks + pool.num_evictable_blocks + used == pool.num_blocks
        assert pool.num_used_blocks == used
        assert self.cache.num_evictable_blocks == sum(1 for b in pool.blocks if b.cached and b.ref_cnt == 0)
        assert not kv.pending_saves and not kv.pending_loads and not kv.pending_copies and not kv.in_flight

    @invariant()
    def tiers_within_their_size(self) -> None:
        for tier in (self.host, self.disk):
            assert 0 <= tier.used_bytes <= tier.capacity_bytes, f"{tier.name} over its capacity"
        assert len(self.host) <= self.host_blocks and len(self.disk) <= self.disk_blocks
        assert self.host.used_bytes == len(self.host) * self.ns.block_nbytes
        assert self.disk.used_bytes == len(self.disk) * self.file_size
        files = list(self.disk.directory.glob(f"*/*{SUFFIX}")) if self.disk.directory.exists() else []
        assert len(files) == len(self.disk) and all(f.stat().st_size == self.file_size for f in files)
        assert not self.host.stats.errors and not self.disk.stats.errors
        assert self.host.stats.dropped_writes == 0 and self.disk.stats.dropped_writes <= self.num_saved

    @invariant()
    def loads_accounted(self) -> None:
        assert set(self.kv.loads) == set(self.plans)
        assert set(self.kv.loads) <= {r.seq_id for r in self.waiting + self.loading}
        for req in self.loading:  # a load under way is not ready (its deadline is far)
            assert self.plans[req.seq_id].arrived is None and not self.kv.load_ready(req)
        served = sum(self.store.use[t].served for t in ("host", "disk"))
        assert served == sum(self.num_loaded.values())
        assert dict(self.store.errors) == ({"load_timeout": self.num_timeouts} if self.num_timeouts else {})

    @invariant()
    def tables_hold_exactly_their_tokens(self) -> None:
        assert set(self.kv.block_tables) == {r.seq_id for r in self.running}
        for req in self.running:
            table = self.kv.block_tables[req.seq_id]
            assert len(table) == cdiv(req.num_computed_tokens, self.bs)
            assert all(b.cached for b in table[: req.num_computed_tokens // self.bs])
            self._check_holds(req, req.num_computed_tokens)

    def teardown(self) -> None:
        if not hasattr(self, "store"):
            return
        try:
            if hasattr(self, "kv"):
                for req in self.running + self.waiting + self.loading:
                    self.kv.free(req)
                assert self.kv.pool.num_used_blocks == 0
                self.kv.check_integrity()
        finally:
            self.gate.open_all()  # loads still queued (timed out, aborted) run and end
            self.store.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class RadixTierMachine(TierMachine):
    kind = "radix"


class HashTierMachine(TierMachine):
    kind = "hash"


SETTINGS = settings(max_examples=50, stateful_step_count=50, deadline=None)
RadixTierMachine.TestCase.settings = SETTINGS
HashTierMachine.TestCase.settings = SETTINGS
TestRadixTiersStateful = RadixTierMachine.TestCase
TestHashTiersStateful = HashTierMachine.TestCase


# Paths the machine reaches only now and then, driven step by step (the invariants after each).

P = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # 4 reusable blocks of 2 tokens
Q = (7, 7, 7, 7, 7, 7)


def checked(machine: TierMachine) -> TierMachine:
    machine.device_blocks_add_up()
    machine.tiers_within_their_size()
    machine.loads_accounted()
    machine.tables_hold_exactly_their_tokens()
    return machine


def scenario(
    machine_class: type[TierMachine], policy: WritePolicy, host_blocks: int, disk_blocks: int, block_size: int = 2
):
    m = machine_class()
    m.setup(
        num_blocks=8, block_size=block_size, host_blocks=host_blocks, disk_blocks=disk_blocks, slack=0, policy=policy
    )
    return checked(m)


def admit(m: TierMachine, req: Req) -> Req:
    m._schedule([(req, 1 << 10)])
    checked(m)
    return req


@pytest.mark.parametrize("machine_class", [RadixTierMachine, HashTierMachine])
def test_a_load_whose_device_hit_grew_meanwhile_brings_only_the_blocks_after_it(machine_class):
    m = scenario(machine_class, WritePolicy.WRITE_BACK, host_blocks=1, disk_blocks=8)
    try:
        for prompt, salt in [(P, b""), (Q + (1,), b""), (Q + (2,), SALTS[1]), (P[:6] + (0, 0), SALTS[2])]:
            checked(m).serve(prompt, [], salt)
        req = admit(m, m._new(P, [], b""))  # every block of P is on disk now
        assert req in m.loading and m.plans[req.seq_id].first == 0 and len(m.plans[req.seq_id].tiers) == 4
        other = admit(m, m._new(P[:5], [], b""))  # its first two blocks: waits for the same disk reads
        assert other in m.loading
        checked(m)._time_out(other)
        admit(m, other)  # computes them, and holds them in the pool
        checked(m)._arrive(req)
        assert m.plans[req.seq_id].arrived == 4 and m.kv.match_prefix(req).num_blocks == 2
        admit(m, req)
        assert req in m.running and req.num_computed_tokens == len(P)
        assert m.store.use["disk"].served == 2  # blocks 2 and 3: the pool had 0 and 1 by then
    finally:
        m.teardown()


@pytest.mark.parametrize("machine_class", [RadixTierMachine, HashTierMachine])
def test_a_load_whose_device_hit_was_evicted_meanwhile_is_not_used(machine_class):
    m = scenario(machine_class, WritePolicy.WRITE_THROUGH, host_blocks=1, disk_blocks=20)
    try:
        for prompt, salt in [(P, b""), (Q[:5], b""), (Q + (1,), SALTS[1])]:  # the pool keeps P's first 2 blocks
            checked(m).serve(prompt, [], salt)
        req = admit(m, m._new(P, [], b""))
        assert req in m.loading and m.plans[req.seq_id].first == 2 and len(m.plans[req.seq_id].tiers) == 2
        checked(m).serve(Q + (2,), [], SALTS[2])  # evicts them
        assert m.kv.match_prefix(req).num_blocks == 0
        checked(m)._arrive(req)
        assert m.plans[req.seq_id].arrived == 2
        admit(m, req)  # blocks 2 and 3 no longer continue anything in the pool: it computes all
        assert req in m.running and req.num_computed_tokens == len(P) and m.store.use["disk"].served == 0
    finally:
        m.teardown()


@pytest.mark.parametrize("machine_class", [RadixTierMachine, HashTierMachine])
def test_a_run_on_disk_is_read_from_disk_though_host_ram_holds_part_of_it(machine_class):
    m = scenario(machine_class, WritePolicy.WRITE_THROUGH, host_blocks=2, disk_blocks=3, block_size=3)
    try:
        m.serve(P, [], b"")  # disk holds its 3 blocks, host RAM the last 2
        m.reset()
        req = admit(m, m._new(P, [], b""))
        assert req in m.loading and m.plans[req.seq_id].tiers == [m.disk, m.disk]  # one read, not disk then host
        admit(m, m._new(P[:3], [], b""))  # block 0 into host RAM, which drops block 1
        checked(m)._arrive(req)
        assert m.plans[req.seq_id].arrived == 2 and m.store.use["disk"].served == 0
        admit(m, req)  # block 0 is in the pool by now: disk serves block 1
        assert req in m.running and req.num_computed_tokens == len(P) and m.store.use["disk"].served == 1
    finally:
        m.teardown()
