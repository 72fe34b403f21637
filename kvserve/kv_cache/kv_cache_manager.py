"""What the scheduler talks to: match a cached prefix, allocate slots, fork, free.

Each request owns a `BlockTable`, its physical blocks in logical order. Blocks are
taken only when tokens are about to be written and given back the moment a
request finishes, is aborted or preempted. A failed allocation changes nothing.
With a prefix cache, a new request starts from the cached blocks of its longest
cached prefix, and every block that fills (prompt or generated tokens) is
inserted so later requests, and this one after a preemption, find it.

A prefix no request has finished computing is shared too: the full blocks a step will
fill are registered, by their chained keys, as they are allocated ("in flight"), and a
request admitted in the same step continues its match through them. Its attention reads
them in the same forward, after they are written: every layer writes the step's new K/V
before it attends. So requests that arrive together compute a shared prefix once, with
no one waiting for another (SGLang instead defers the followers by a step).

With tiers below the pool (`tiers.store.TieredKVStore`), a request's match continues
there: `start_load` looks up the blocks after its device hit, the request waits (off
the step loop) while they arrive, and `queue_loads` writes them into freshly allocated
blocks before the step's forward. Blocks leaving the pool, or filling, are queued in
`pending_saves` for the engine to read out and store.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from kvserve.kv_cache.block_keys import extend_keys
from kvserve.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvserve.kv_cache.hash_chain_cache import HashChainCache
from kvserve.kv_cache.prefix_cache import PrefixCache, PrefixMatch
from kvserve.kv_cache.radix_cache import RadixCache
from kvserve.kv_cache.request import KVRequest
from kvserve.kv_cache.tiers.store import KVLoad, Payload, TieredKVStore

PREFIX_CACHES: dict[str, type[PrefixCache]] = {"radix": RadixCache, "hash": HashChainCache}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_prefix_cache(kind: str | None, block_size: int) -> PrefixCache | None:
    if kind is None:
        return None
    if kind not in PREFIX_CACHES:
        raise ValueError(f"prefix_cache must be one of {', '.join(PREFIX_CACHES)}; got {kind!r}")
    return PREFIX_CACHES[kind](block_size)


@dataclass(frozen=True)
class BlockCopy:
    """Copy-on-write: copy K/V of block `src` into `dst` before this step's forward."""

    src: int
    dst: int


@dataclass
class CachedPrefix:
    """How much of a request's table the prefix cache holds, and where to continue."""

    handle: object
    num_blocks: int


@dataclass(frozen=True)
class PrefixHit:
    """A new request's reusable prefix: what the prefix cache holds, then blocks that
    requests scheduled in this step are computing."""

    cached: PrefixMatch
    in_flight: list[KVCacheBlock]

    @property
    def blocks(self) -> list[KVCacheBlock]:
        return self.cached.blocks + self.in_flight

    @property
    def num_blocks(self) -> int:
        return self.cached.num_blocks + len(self.in_flight)


@dataclass(frozen=True)
class BlockSave:
    """Read block `block_id`'s K/V out and store it under `block_key`: it just filled
    (`filled`), or it is being evicted and is rewritten by this step's forward."""

    block_key: bytes
    block_id: int
    filled: bool


@dataclass(frozen=True)
class BlockLoad:
    """Write `payload` (from a tier) into block `block_id` before this step's forward."""

    block_id: int
    payload: Payload


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at admission
    hits: int = 0  # of those, tokens found cached in the device pool
    external_queries: int = 0  # tokens looked up in the tiers (after the device hit)
    external_hits: int = 0  # of those, tokens loaded from a tier


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: PrefixCache | None = None,
        store: TieredKVStore | None = None,
        events: str | None = None,
    ):
        """`events`: None (no events kept), "hashes" or "tokens" (token ids too: an opt-in)."""
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.store = store if prefix_cache is not None else None
        self.pool = BlockPool(num_blocks, evictor=prefix_cache, on_evict=self._on_evict)
        self.block_tables: dict[int, list[KVCacheBlock]] = {}  # by KVRequest.seq_id
        self.cached_prefixes: dict[int, CachedPrefix] = {}  # by KVRequest.seq_id
        self.pending_copies: list[BlockCopy] = []
        self.in_flight: dict[bytes, KVCacheBlock] = {}  # block key -> block being filled this step
        self.num_cow_copies = 0
        self.prefix_stats = PrefixCacheStats()
        self.loads: dict[int, KVLoad] = {}  # by KVRequest.seq_id: lookups in the tiers
        self.pending_saves: list[BlockSave] = []
        self.pending_loads: list[BlockLoad] = []
        self.events: list[KVCacheEvent] | None = [] if events else None
        self.event_token_ids = events == "tokens"

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_ids(self, request: KVRequest) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request.seq_id, ())]

    def match_prefix(self, request: KVRequest) -> PrefixHit | None:
        """The blocks a request with no blocks yet can start from: cached, then in flight (changes no ref count)."""
        if self.prefix_cache is None:
            return None
        usable = (request.num_tokens - 1) // self.block_size  # blocks: the last token's logits are needed
        keys = self._block_keys(request, usable)[:usable]
        cached = self.prefix_cache.match_prefix(
            request.all_token_ids[: usable * self.block_size], request.extra_key, keys
        )
        in_flight = []
        for key in keys[cached.num_blocks :]:
            if key not in self.in_flight:
                break
            in_flight.append(self.in_flight[key])
        return PrefixHit(cached, in_flight)

    def _block_keys(self, request: KVRequest, num_blocks: int) -> list[bytes]:
        """The request's chained block keys, its first `num_blocks` at least (each computed once)."""
        extend_keys(request.block_keys, request.all_token_ids, num_blocks, self.block_size, request.extra_key)
        return request.block_keys

    def blocks_needed(self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Blocks (new ones, a copy-on-write one, evictable hits revived) that scheduling these tokens takes."""
        table = self.block_tables.get(request.seq_id, [])
        hit_blocks = hit.blocks if hit else []
        start = request.num_computed_tokens + len(hit_blocks) * self.block_size
        grow = max(0, cdiv(start + num_new_tokens, self.block_size) - max(len(table), len(hit_blocks)))
        revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        return grow + revived + int(self._shared_tail(table, start) is not None)

    def allocate_slots(self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` after the computed (and hit) ones; False, and no change, if out of blocks.

        `hit` (from `match_prefix`) is only given for a request that holds no blocks yet.
        """
        if self.blocks_needed(request, num_new_tokens, hit) > self.pool.num_available_blocks:
            return False
        table = self.block_tables.setdefault(request.seq_id, [])
        if hit is not None:
            self.pool.incr_ref(hit.blocks)  # before allocating, so eviction cannot take them
            table.extend(hit.blocks)
            self.cached_prefixes[request.seq_id] = CachedPrefix(hit.cached.handle, hit.cached.num_blocks)
        start = request.num_computed_tokens + (hit.num_blocks * self.block_size if hit else 0)
        shared = self._shared_tail(table, start)
        if shared is not None:
            self._copy_on_write(table, shared)
        grow = cdiv(start + num_new_tokens, self.block_size) - len(table)
        if grow > 0:
            table.extend(self.pool.get_new_blocks(grow))
        self._register_in_flight(request, table, start, start + num_new_tokens)
        return True

    def _register_in_flight(self, request: KVRequest, table: list[KVCacheBlock], start: int, end: int) -> None:
        """The blocks tokens [start, end) fill, matchable by requests admitted in the same step."""
        first, last = start // self.block_size, end // self.block_size
        if self.prefix_cache is None or first == last:  # most decodes fill no block
            return
        keys = self._block_keys(request, last)
        for i in range(first, last):
            if keys[i] not in self.in_flight and not table[i].cached:
                self.in_flight[keys[i]] = table[i]

    def _drop_in_flight(self, request: KVRequest, table: list[KVCacheBlock], first: int, last: int) -> None:
        """Forget table[first:last]'s in-flight entries: computed now, or their request freed."""
        for key, block in zip(request.block_keys[first:last], table[first:last], strict=False):
            if self.in_flight.get(key) is block:
                del self.in_flight[key]

    def _shared_tail(self, table: list[KVCacheBlock], start: int) -> int | None:
        """Index of the partly filled block the next token goes into, if others share it."""
        idx = start // self.block_size
        if start % self.block_size and idx < len(table) and table[idx].ref_cnt > 1:
            return idx
        return None

    def _copy_on_write(self, table: list[KVCacheBlock], idx: int) -> None:
        old = table[idx]
        (new,) = self.pool.get_new_blocks(1)
        self.pool.free_blocks([old])  # the other owners keep it
        table[idx] = new
        self.pending_copies.append(BlockCopy(old.block_id, new.block_id))
        self.num_cow_copies += 1

    def take_pending_copies(self) -> list[BlockCopy]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, request: KVRequest) -> None:
        """Insert the blocks this request has filled since the last call (prompt and output tokens)."""
        if self.prefix_cache is None:
            return
        table = self.block_tables[request.seq_id]
        done = self.cached_prefixes.get(request.seq_id) or CachedPrefix(
            self.prefix_cache.root_handle(request.extra_key), 0
        )
        full = request.num_computed_tokens // self.block_size
        if full <= done.num_blocks:
            return
        bs = self.block_size
        tokens = request.all_token_ids[done.num_blocks * bs : full * bs]
        keys = self._block_keys(request, full)[done.num_blocks : full]
        self._drop_in_flight(request, table, done.num_blocks, full)  # computed now: the cache holds them
        handle, held = self.prefix_cache.insert(
            done.handle, tokens, table[done.num_blocks : full], request.extra_key, keys
        )
        stored = []
        for i, block in enumerate(held, start=done.num_blocks):
            if block is not table[i]:  # someone cached this prefix first: share theirs, drop ours
                self.pool.incr_ref([block])
                self.pool.free_blocks([table[i]])
                table[i] = block
            elif block.block_key is None:
                self._offer(block, request.block_keys[i])
                stored.append(i)
        self.cached_prefixes[request.seq_id] = CachedPrefix(handle, full)
        if stored and self.events is not None:
            self._announce_stored(request, stored)

    def _offer(self, block: KVCacheBlock, key: bytes) -> None:
        """A block this request computed is cached now: the tiers may want it now and on eviction."""
        block.block_key = key
        if self.store is not None and self.store.saves_on_fill:
            self.pending_saves.append(BlockSave(key, block.block_id, filled=True))

    def _announce_stored(self, request: KVRequest, indexes: list[int]) -> None:
        """One BlockStored per run of consecutive blocks, with the parent of its first."""
        bs, keys = self.block_size, request.block_keys
        runs: list[list[int]] = []
        for i in indexes:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            tokens = request.all_token_ids[run[0] * bs : (run[-1] + 1) * bs] if self.event_token_ids else []
            parent = keys[run[0] - 1] if run[0] else None
            self.events.append(BlockStored([keys[i] for i in run], parent, tokens, bs))

    def _on_evict(self, blocks: list[KVCacheBlock]) -> None:
        removed = []
        for block in blocks:
            if block.block_key is None:
                continue
            if self.store is not None and self.store.saves_on_evict:
                self.pending_saves.append(BlockSave(block.block_key, block.block_id, filled=False))
            removed.append(block.block_key)
            block.block_key = None
        if removed and self.events is not None:
            self.events.append(BlockRemoved(removed))

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events or [], [] if self.events is not None else None
        return events

    def take_pending_saves(self) -> list[BlockSave]:
        saves, self.pending_saves = self.pending_saves, []
        return saves

    def take_pending_loads(self) -> list[BlockLoad]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def cached_block_saves(self) -> list[BlockSave]:
        """Every cached block, as an eviction would save it (a write-back cache's flush at shutdown)."""
        return [BlockSave(b.block_key, b.block_id, False) for b in self.pool.blocks if b.cached and b.block_key]

    # loads from the tiers

    def start_load(self, request: KVRequest, hit: PrefixHit | None) -> bool:
        """Look the blocks after a waiting request's device hit up in the tiers, once per
        admission; True while it must wait for them (then poll `load_ready`)."""
        if self.store is None or request.seq_id in self.loads:
            return False
        first = hit.num_blocks if hit else 0
        usable = (request.num_tokens - 1) // self.block_size
        load = self.store.start_load(self._block_keys(request, usable)[first:usable], first)
        if load is None:
            return False
        self.loads[request.seq_id] = load
        return not load.done

    def wait_for_load(self, request: KVRequest, until: float) -> bool:
        """Wait until `until` (time.monotonic()) at most for the request's load; True once it is over."""
        load = self.loads[request.seq_id]
        if (left := until - time.monotonic()) > 0:
            self.store.wait_for_loads([load], timeout=left)
        return self.load_ready(request)

    def load_ready(self, request: KVRequest) -> bool:
        """Its load arrived, failed or timed out (then it computes what it would have loaded)."""
        load = self.loads.get(request.seq_id)
        if load is None or load.done:
            return True
        if time.monotonic() > load.deadline:
            load.result = []
            self.store.record_timeout()
            return True
        return False

    def loaded_blocks(self, request: KVRequest, hit: PrefixHit | None) -> list[tuple[str, Payload]]:
        """The loaded blocks that continue the request's device hit now, as (tier, payload)."""
        load = self.loads.get(request.seq_id)
        if load is None:
            return []
        skip = (hit.num_blocks if hit else 0) - load.first_block
        return load.payloads()[skip:] if skip >= 0 else []  # skip < 0: the blocks it continued were evicted

    def queue_loads(self, request: KVRequest, first_block: int, loaded: list[tuple[str, Payload]]) -> None:
        """After `allocate_slots` covered them: write the loaded blocks into the table's fresh blocks."""
        self.loads.pop(request.seq_id, None)
        table = self.block_tables[request.seq_id]
        for i, (_, payload) in enumerate(loaded, start=first_block):
            self.pending_loads.append(BlockLoad(table[i].block_id, payload))
        if loaded:
            self.store.record_served(loaded)

    def fork(self, parent: KVRequest, child: KVRequest) -> None:
        """The child shares every block of the parent, the partly filled last one too."""
        table = self.block_tables[parent.seq_id]
        self.pool.incr_ref(table)
        self.block_tables[child.seq_id] = list(table)
        if parent.seq_id in self.cached_prefixes:
            done = self.cached_prefixes[parent.seq_id]
            self.cached_prefixes[child.seq_id] = CachedPrefix(done.handle, done.num_blocks)

    def free(self, request: KVRequest) -> None:
        self.loads.pop(request.seq_id, None)
        self.cached_prefixes.pop(request.seq_id, None)
        table = self.block_tables.pop(request.seq_id, [])
        self._drop_in_flight(request, table, 0, len(table))
        self.pool.free_blocks(reversed(table))  # tail first: evicted before its prefix

    def check_integrity(self) -> None:
        """The pool's and the prefix cache's invariants, each block's ref count = the tables holding
        it, and the in-flight blocks held and not yet cached."""
        self.pool.check_integrity()
        if self.prefix_cache is not None:
            self.prefix_cache.check_integrity()
        held = Counter(b.block_id for table in self.block_tables.values() for b in table)
        wrong = [b.block_id for b in self.pool.blocks if b.ref_cnt != held[b.block_id]]
        assert not wrong, f"blocks {wrong[:5]} have ref counts that differ from the tables holding them"
        assert all(b.ref_cnt > 0 and not b.cached for b in self.in_flight.values()), (
            "an in-flight block is free or already cached"
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        if self.block_tables:
            return False
        if self.prefix_cache is not None:
            self.pool.reclaim(self.pool.num_evictable_blocks)
            self.pending_saves.clear()  # forgotten here, not pushed down to the tiers
            if self.events is not None:
                self.events = [AllBlocksCleared()]
        return True
